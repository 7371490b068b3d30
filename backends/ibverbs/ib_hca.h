/* SPDX-License-Identifier: Apache-2.0
 *
 * ib_hca.h - the parser of $XCCL_IB_HCA, which names the RDMA devices and ports the ibverbs
 * transport may use, in NCCL's syntax (NCCL_IB_HCA):
 *
 *     mlx5_0:1,mlx5_1      devices whose name starts with "mlx5_0" (port 1 only) or "mlx5_1"
 *     =mlx5_0              exactly the device "mlx5_0" (any port)
 *     ^mlx5_2              every device but those starting with "mlx5_2"
 *     ^=mlx5_2:1           every (device, port) but exactly mlx5_2 port 1
 *
 * An entry is a device name (letters, digits, '_', '-', '.'; at most XCCL_IB_HCA_NAME - 1
 * characters) and optionally ':' and a port number (1..255). Blanks around entries are
 * ignored; an empty spec (or one of blanks) allows everything. Pure functions, no verbs: unit
 * tested alone (tests/c/test_ibhca.c).
 */
#ifndef XCCL_IB_HCA_H
#define XCCL_IB_HCA_H

#include <stddef.h>

#define XCCL_IB_HCA_MAX  32 /* entries */
#define XCCL_IB_HCA_NAME 64 /* bytes of a name, NUL included */

typedef struct xccl_ib_hca_ent {
    char name[XCCL_IB_HCA_NAME];
    int  port; /* 0: any port */
} xccl_ib_hca_ent_t;

typedef struct xccl_ib_hca {
    int               exclude; /* '^': the entries are the ones NOT to use */
    int               exact;   /* '=': names must match exactly, not as a prefix */
    int               n;       /* 0: every device and port is allowed */
    xccl_ib_hca_ent_t ent[XCCL_IB_HCA_MAX];
} xccl_ib_hca_t;

/* Parses spec (NULL: allow all) into *out. 0 on success; -1 with a message in err (which names
 * the offending entry) on a syntax error. */
int xccl_ib_hca_parse(const char *spec, xccl_ib_hca_t *out, char *err, size_t errlen);
/* 1 if port `port` of device `dev` may be used under h. */
int xccl_ib_hca_match(const xccl_ib_hca_t *h, const char *dev, int port);

#endif /* XCCL_IB_HCA_H */
