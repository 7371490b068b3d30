/* SPDX-License-Identifier: Apache-2.0
 *
 * error_api.c - xccl_set_error: lets code outside the library (the Python extension's custom
 * store callbacks) record a last-error message through the public API.
 */
#include "core/check.h"

xccl_status_t xccl_set_error(xccl_status_t st, const char *msg)
{
    return xccl_error_set(st, "%s", msg != NULL ? msg : "");
}
