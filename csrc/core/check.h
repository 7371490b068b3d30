/* SPDX-License-Identifier: Apache-2.0
 *
 * check.h - error reporting and propagation, logging, clocks, shared by the core, the algorithms
 * and the backends. They are public (xccl/xccl_tp_support.h, which documents them) because
 * transports built out of tree use them too.
 */
#ifndef XCCL_CORE_CHECK_H
#define XCCL_CORE_CHECK_H

#include <errno.h>
#include <stdint.h>

#include "xccl/xccl.h"
#include "xccl/xccl_tp_support.h"

#endif /* XCCL_CORE_CHECK_H */
