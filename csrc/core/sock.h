/* SPDX-License-Identifier: Apache-2.0
 *
 * sock.h - small socket helpers shared by the TCP store and the TCP transport: interface
 * selection, listening, connecting with a deadline, and full reads/writes with a deadline on
 * sockets in blocking or non-blocking mode (poll-based). Declared in xccl/xccl_tp_support.h,
 * since transports built out of tree use them too.
 */
#ifndef XCCL_CORE_SOCK_H
#define XCCL_CORE_SOCK_H

#include "xccl/xccl_tp_support.h"

#endif /* XCCL_CORE_SOCK_H */
