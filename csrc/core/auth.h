/* SPDX-License-Identifier: Apache-2.0
 *
 * auth.h - SHA-256 (FIPS 180-4), HMAC-SHA-256 (RFC 2104) and the challenge-response used by
 * the TCP store and the TCP transport. Written from the standards.
 *
 * Challenge-response (the key never crosses the wire):
 *   each side sends a fresh 32-byte random nonce; each side then proves knowledge of the key
 *   by sending HMAC(key, role || own_nonce || peer_nonce || context), where role separates the
 *   two directions so a proof cannot be reflected back; each side checks the peer's proof in
 *   constant time.
 */
#ifndef XCCL_CORE_AUTH_H
#define XCCL_CORE_AUTH_H

#include <stddef.h>
#include <stdint.h>

#include "xccl/xccl.h"
#include "xccl/xccl_tp_support.h" /* xccl_random_bytes, xccl_auth_handshake */

#define XCCL_SHA256_LEN 32
#define XCCL_NONCE_LEN  32

typedef struct xccl_sha256 {
    uint32_t h[8];
    uint64_t nbytes;
    uint8_t  buf[64];
    size_t   buflen;
} xccl_sha256_t;

void xccl_sha256_init(xccl_sha256_t *s);
void xccl_sha256_update(xccl_sha256_t *s, const void *data, size_t len);
void xccl_sha256_final(xccl_sha256_t *s, uint8_t out[XCCL_SHA256_LEN]);
void xccl_sha256(const void *data, size_t len, uint8_t out[XCCL_SHA256_LEN]);

void xccl_hmac_sha256(const void *key, size_t keylen, const void *msg, size_t msglen,
                      uint8_t out[XCCL_SHA256_LEN]);

/* Constant-time comparison: 1 if equal. */
int xccl_ct_equal(const void *a, const void *b, size_t len);

/* proof = HMAC(key, role(1 byte) || nonce_self || nonce_peer || context). */
void xccl_auth_proof(const void *key, size_t keylen, uint8_t role,
                     const uint8_t nonce_self[XCCL_NONCE_LEN],
                     const uint8_t nonce_peer[XCCL_NONCE_LEN], const void *context,
                     size_t contextlen, uint8_t proof[XCCL_SHA256_LEN]);

/* Wire layout of the handshake (added with auth.c; the TCP store's server speaks it as a state
 * machine, xccl_auth_handshake speaks it blocking). Both sides do, in this order:
 *   send hello   [u32 XCCL_AUTH_MAGIC, big-endian][nonce_self, 32 bytes]; receive the peer's
 *   send proof   [32 bytes] = xccl_auth_proof(key, role_self, nonce_self, nonce_peer, context);
 *                receive the peer's and check it against role_peer
 *   send verdict [u8] 1 = the peer's proof was right, 0 = wrong (the sender then closes);
 *                receive the peer's
 * Roles: XCCL_AUTH_ROLE_SERVER for the accepting side, XCCL_AUTH_ROLE_CLIENT for the other. */
#define XCCL_AUTH_MAGIC       0x58415531u /* "XAU1" */
#define XCCL_AUTH_HELLO_LEN   (4 + XCCL_NONCE_LEN)
#define XCCL_AUTH_ROLE_CLIENT 0x43 /* 'C' */
#define XCCL_AUTH_ROLE_SERVER 0x53 /* 'S' */

#endif /* XCCL_CORE_AUTH_H */
