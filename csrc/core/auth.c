/* SPDX-License-Identifier: Apache-2.0
 *
 * auth.c - SHA-256 (FIPS 180-4 section 6.2), HMAC-SHA-256 (RFC 2104), random nonces, and the
 * blocking challenge-response handshake described in auth.h.
 */
#include "core/auth.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>

#include "core/check.h"
#include "core/sock.h"

/* ---------------------------------------------------------------------------------------------
 * SHA-256. The message is processed in 64-byte blocks; each block expands into the 64-word
 * schedule W and runs 64 rounds over the eight working variables a..h. The final block carries
 * a 1 bit, zero padding and the 64-bit big-endian message length in bits.
 * ------------------------------------------------------------------------------------------- */

/* First 32 bits of the fractional parts of the cube roots of the first 64 primes. */
static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2,
};

static inline uint32_t rotr(uint32_t x, unsigned n) { return (x >> n) | (x << (32 - n)); }

static inline uint32_t load_be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static inline void store_be32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

static void sha256_block(uint32_t h[8], const uint8_t block[64])
{
    uint32_t w[64];
    uint32_t a, b, c, d, e, f, g, hh;
    int      t;

    for (t = 0; t < 16; t++) w[t] = load_be32(block + 4 * t);
    for (t = 16; t < 64; t++) {
        uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
        uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
        w[t]        = w[t - 16] + s0 + w[t - 7] + s1;
    }
    a  = h[0];
    b  = h[1];
    c  = h[2];
    d  = h[3];
    e  = h[4];
    f  = h[5];
    g  = h[6];
    hh = h[7];
    for (t = 0; t < 64; t++) {
        uint32_t big1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25);
        uint32_t ch   = (e & f) ^ (~e & g);
        uint32_t t1   = hh + big1 + ch + K[t] + w[t];
        uint32_t big0 = rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22);
        uint32_t maj  = (a & b) ^ (a & c) ^ (b & c);
        uint32_t t2   = big0 + maj;
        hh            = g;
        g             = f;
        f             = e;
        e             = d + t1;
        d             = c;
        c             = b;
        b             = a;
        a             = t1 + t2;
    }
    h[0] += a;
    h[1] += b;
    h[2] += c;
    h[3] += d;
    h[4] += e;
    h[5] += f;
    h[6] += g;
    h[7] += hh;
}

void xccl_sha256_init(xccl_sha256_t *s)
{
    /* First 32 bits of the fractional parts of the square roots of the first 8 primes. */
    static const uint32_t h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

    memcpy(s->h, h0, sizeof(h0));
    s->nbytes = 0;
    s->buflen = 0;
}

void xccl_sha256_update(xccl_sha256_t *s, const void *data, size_t len)
{
    const uint8_t *p = data;

    s->nbytes += len;
    if (s->buflen > 0) {
        size_t take = 64 - s->buflen < len ? 64 - s->buflen : len;
        memcpy(s->buf + s->buflen, p, take);
        s->buflen += take;
        p += take;
        len -= take;
        if (s->buflen < 64) return;
        sha256_block(s->h, s->buf);
        s->buflen = 0;
    }
    for (; len >= 64; p += 64, len -= 64) sha256_block(s->h, p);
    memcpy(s->buf, p, len);
    s->buflen = len;
}

void xccl_sha256_final(xccl_sha256_t *s, uint8_t out[XCCL_SHA256_LEN])
{
    uint64_t bits = s->nbytes * 8;
    int      i;

    s->buf[s->buflen++] = 0x80;
    if (s->buflen > 56) {
        memset(s->buf + s->buflen, 0, 64 - s->buflen);
        sha256_block(s->h, s->buf);
        s->buflen = 0;
    }
    memset(s->buf + s->buflen, 0, 56 - s->buflen);
    for (i = 0; i < 8; i++) s->buf[56 + i] = (uint8_t)(bits >> (56 - 8 * i));
    sha256_block(s->h, s->buf);
    for (i = 0; i < 8; i++) store_be32(out + 4 * i, s->h[i]);
    memset(s, 0, sizeof(*s));
}

void xccl_sha256(const void *data, size_t len, uint8_t out[XCCL_SHA256_LEN])
{
    xccl_sha256_t s;

    xccl_sha256_init(&s);
    xccl_sha256_update(&s, data, len);
    xccl_sha256_final(&s, out);
}

/* ---------------------------------------------------------------------------------------------
 * HMAC (RFC 2104): H((K0 ^ opad) || H((K0 ^ ipad) || msg)), where K0 is the key padded to the
 * 64-byte block (or its hash, padded, when longer than a block).
 * ------------------------------------------------------------------------------------------- */

/* Starts the inner hash and keeps the outer padded key for hmac_end. */
static void hmac_begin(xccl_sha256_t *inner, uint8_t opad_key[64], const void *key,
                       size_t keylen)
{
    uint8_t k0[64] = {0};
    uint8_t ipad_key[64];
    int     i;

    if (keylen > 64) xccl_sha256(key, keylen, k0);
    else if (keylen > 0) memcpy(k0, key, keylen);
    for (i = 0; i < 64; i++) {
        ipad_key[i] = k0[i] ^ 0x36;
        opad_key[i] = k0[i] ^ 0x5c;
    }
    xccl_sha256_init(inner);
    xccl_sha256_update(inner, ipad_key, 64);
    memset(k0, 0, sizeof(k0));
    memset(ipad_key, 0, sizeof(ipad_key));
}

static void hmac_end(xccl_sha256_t *inner, uint8_t opad_key[64], uint8_t out[XCCL_SHA256_LEN])
{
    uint8_t       ihash[XCCL_SHA256_LEN];
    xccl_sha256_t outer;

    xccl_sha256_final(inner, ihash);
    xccl_sha256_init(&outer);
    xccl_sha256_update(&outer, opad_key, 64);
    xccl_sha256_update(&outer, ihash, sizeof(ihash));
    xccl_sha256_final(&outer, out);
    memset(opad_key, 0, 64);
}

void xccl_hmac_sha256(const void *key, size_t keylen, const void *msg, size_t msglen,
                      uint8_t out[XCCL_SHA256_LEN])
{
    xccl_sha256_t inner;
    uint8_t       opad_key[64];

    hmac_begin(&inner, opad_key, key, keylen);
    xccl_sha256_update(&inner, msg, msglen);
    hmac_end(&inner, opad_key, out);
}

/* ---------------------------------------------------------------------------------------------
 * Randomness, comparison, proofs
 * ------------------------------------------------------------------------------------------- */

xccl_status_t xccl_random_bytes(void *buf, size_t len)
{
    uint8_t *p = buf;

    while (len > 0) {
        ssize_t n = getrandom(p, len, 0);
        if (n < 0) {
            if (errno == EINTR) continue;
            return XCCL_ERROR(XCCL_ERR_SYSTEM, "getrandom(%zu bytes) failed: %s", len,
                              strerror(errno));
        }
        p += n;
        len -= (size_t)n;
    }
    return XCCL_OK;
}

int xccl_ct_equal(const void *a, const void *b, size_t len)
{
    const volatile uint8_t *x   = a;
    const volatile uint8_t *y   = b;
    uint8_t                 acc = 0;
    size_t                  i;

    for (i = 0; i < len; i++) acc |= x[i] ^ y[i];
    return acc == 0;
}

void xccl_auth_proof(const void *key, size_t keylen, uint8_t role,
                     const uint8_t nonce_self[XCCL_NONCE_LEN],
                     const uint8_t nonce_peer[XCCL_NONCE_LEN], const void *context,
                     size_t contextlen, uint8_t proof[XCCL_SHA256_LEN])
{
    xccl_sha256_t inner;
    uint8_t       opad_key[64];

    hmac_begin(&inner, opad_key, key, keylen);
    xccl_sha256_update(&inner, &role, 1);
    xccl_sha256_update(&inner, nonce_self, XCCL_NONCE_LEN);
    xccl_sha256_update(&inner, nonce_peer, XCCL_NONCE_LEN);
    xccl_sha256_update(&inner, context, contextlen);
    hmac_end(&inner, opad_key, proof);
}

/* ---------------------------------------------------------------------------------------------
 * Blocking handshake (wire layout in auth.h): hello, proof, verdict; three round trips.
 * ------------------------------------------------------------------------------------------- */

static const char *peer_name(int fd, char *buf, size_t len)
{
    xccl_sockaddr_t a;

    a.len = sizeof(a.ss);
    if (getpeername(fd, (struct sockaddr *)&a.ss, &a.len) != 0 ||
        (a.ss.ss_family != AF_INET && a.ss.ss_family != AF_INET6)) {
        snprintf(buf, len, "fd %d", fd);
        return buf;
    }
    return xccl_sock_str(&a, buf, len);
}

xccl_status_t xccl_auth_handshake(int fd, const void *key, size_t keylen, int is_server,
                                  const char *context, int64_t deadline_ms)
{
    uint8_t       hello[XCCL_AUTH_HELLO_LEN];
    uint8_t       peer_hello[XCCL_AUTH_HELLO_LEN];
    uint8_t       proof[XCCL_SHA256_LEN];
    uint8_t       peer_proof[XCCL_SHA256_LEN];
    uint8_t       expect[XCCL_SHA256_LEN];
    uint8_t       verdict, peer_verdict;
    uint8_t       role      = is_server ? XCCL_AUTH_ROLE_SERVER : XCCL_AUTH_ROLE_CLIENT;
    uint8_t       peer_role = is_server ? XCCL_AUTH_ROLE_CLIENT : XCCL_AUTH_ROLE_SERVER;
    size_t        ctxlen    = context ? strlen(context) : 0;
    const uint8_t *nonce      = hello + 4;
    const uint8_t *peer_nonce = peer_hello + 4;
    char          name[128];

    if (key == NULL || keylen == 0)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "auth handshake: empty key");
    store_be32(hello, XCCL_AUTH_MAGIC);
    XCCL_CHECK(xccl_random_bytes(hello + 4, XCCL_NONCE_LEN));
    XCCL_CHECK(xccl_sock_send_all(fd, hello, sizeof(hello), deadline_ms));
    XCCL_CHECK(xccl_sock_recv_all(fd, peer_hello, sizeof(peer_hello), deadline_ms));
    if (load_be32(peer_hello) != XCCL_AUTH_MAGIC)
        return XCCL_ERROR(XCCL_ERR_AUTH,
                          "auth handshake (%s) with %s: the peer did not answer with an xccl "
                          "auth hello (does it expect no key?)",
                          context ? context : "", peer_name(fd, name, sizeof(name)));
    if (memcmp(nonce, peer_nonce, XCCL_NONCE_LEN) == 0)
        return XCCL_ERROR(XCCL_ERR_AUTH, "auth handshake (%s) with %s: nonce reflected",
                          context ? context : "", peer_name(fd, name, sizeof(name)));

    xccl_auth_proof(key, keylen, role, nonce, peer_nonce, context, ctxlen, proof);
    XCCL_CHECK(xccl_sock_send_all(fd, proof, sizeof(proof), deadline_ms));
    XCCL_CHECK(xccl_sock_recv_all(fd, peer_proof, sizeof(peer_proof), deadline_ms));
    xccl_auth_proof(key, keylen, peer_role, peer_nonce, nonce, context, ctxlen, expect);
    verdict = (uint8_t)xccl_ct_equal(expect, peer_proof, sizeof(expect));

    if (!verdict) {
        /* best effort: the peer may already have hung up after failing us in turn */
        (void)!send(fd, &verdict, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
        return XCCL_ERROR(XCCL_ERR_AUTH,
                          "auth handshake (%s): %s failed authentication (wrong key?)",
                          context ? context : "", peer_name(fd, name, sizeof(name)));
    }
    XCCL_CHECK(xccl_sock_send_all(fd, &verdict, 1, deadline_ms));
    XCCL_CHECK(xccl_sock_recv_all(fd, &peer_verdict, 1, deadline_ms));
    if (peer_verdict != 1)
        return XCCL_ERROR(XCCL_ERR_AUTH,
                          "auth handshake (%s): %s rejected our proof (wrong key?)",
                          context ? context : "", peer_name(fd, name, sizeof(name)));
    return XCCL_OK;
}
