/* SPDX-License-Identifier: Apache-2.0
 *
 * test_auth.c - SHA-256 against the FIPS 180-2 example digests (plus padding-boundary lengths
 * computed with Python's hashlib), HMAC-SHA-256 against RFC 4231 test cases 1-7, the proof
 * layout, and the blocking handshake over a socketpair (right key, wrong key, wrong context,
 * a peer that is not speaking the protocol, a silent peer).
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/auth.h"
#include "core/check.h"
#include "ctest.h"

static void hex(const uint8_t *p, size_t n, char *out)
{
    static const char d[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i]     = d[p[i] >> 4];
        out[2 * i + 1] = d[p[i] & 15];
    }
    out[2 * n] = '\0';
}

static int sha_is(const void *msg, size_t len, const char *want)
{
    uint8_t d[XCCL_SHA256_LEN];
    char    h[2 * XCCL_SHA256_LEN + 1];

    xccl_sha256(msg, len, d);
    hex(d, sizeof(d), h);
    if (strcmp(h, want) != 0) fprintf(stderr, "sha256 len %zu: got %s want %s\n", len, h, want);
    return strcmp(h, want) == 0;
}

/* The same message fed in chunks of `step` bytes must give the same digest. */
static int sha_chunked_is(const void *msg, size_t len, size_t step, const char *want)
{
    xccl_sha256_t  s;
    uint8_t        d[XCCL_SHA256_LEN];
    char           h[2 * XCCL_SHA256_LEN + 1];
    const uint8_t *p = msg;

    xccl_sha256_init(&s);
    for (size_t off = 0; off < len; off += step)
        xccl_sha256_update(&s, p + off, len - off < step ? len - off : step);
    xccl_sha256_final(&s, d);
    hex(d, sizeof(d), h);
    return strcmp(h, want) == 0;
}

static void test_sha256(void)
{
    /* FIPS 180-2, appendix B (and the empty message) */
    static const char m2[] = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
    static const char m3[] = "abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmno"
                             "ijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu";
    static const struct {
        size_t      n;
        const char *d;
    } as[] = {
        /* "a" * n, from Python's hashlib: lengths around the 55/56/64-byte padding edges */
        {55, "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318"},
        {56, "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a"},
        {63, "7d3e74a05d7db15bce4ad9ec0658ea98e3f06eeecf16b4c6fff2da457ddc2f34"},
        {64, "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb"},
        {65, "635361c48bb9eab14198e76ea8ab7f1a41685d6ad62aa9146d301d4f17eb0ae0"},
        {119, "31eba51c313a5c08226adf18d4a359cfdfd8d2e816b13f4af952f7ea6584dcfb"},
        {120, "2f3d335432c70b580af0e8e1b3674a7c020d683aa5f73aaaedfdc55af904c21c"},
        {128, "6836cf13bac400e9105071cd6af47084dfacad4e5e302c94bfed24e013afb73e"},
    };
    const char *million = "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0";
    char       *a       = malloc(1000000);

    CHECK(sha_is("abc", 3, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"));
    CHECK(sha_is("", 0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"));
    CHECK(sha_is(m2, strlen(m2),
                 "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"));
    CHECK(sha_is(m3, strlen(m3),
                 "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1"));
    CHECK(sha_chunked_is(m2, strlen(m2), 1,
                         "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"));
    CHECK(sha_chunked_is(m3, strlen(m3), 7,
                         "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1"));
    memset(a, 'a', 1000000);
    CHECK(sha_is(a, 1000000, million));
    CHECK(sha_chunked_is(a, 1000000, 1000, million));
    CHECK(sha_chunked_is(a, 1000000, 4093, million));
    for (size_t i = 0; i < sizeof(as) / sizeof(as[0]); i++) {
        CHECK_MSG(sha_is(a, as[i].n, as[i].d), "length %zu", as[i].n);
        for (size_t step = 1; step <= 65; step += 8)
            CHECK_MSG(sha_chunked_is(a, as[i].n, step, as[i].d), "length %zu step %zu",
                      as[i].n, step);
    }
    free(a);
}

static void test_hmac(void)
{
    /* RFC 4231 section 4 */
    uint8_t k1[20], k3[20], d3[50], k4[25], d4[50], k5[20], k6[131];
    uint8_t out[XCCL_SHA256_LEN];
    char    h[2 * XCCL_SHA256_LEN + 1];
    const char *m6 = "Test Using Larger Than Block-Size Key - Hash Key First";
    const char *m7 = "This is a test using a larger than block-size key and a larger than "
                     "block-size data. The key needs to be hashed before being used by the "
                     "HMAC algorithm.";

    memset(k1, 0x0b, sizeof(k1));
    memset(k3, 0xaa, sizeof(k3));
    memset(d3, 0xdd, sizeof(d3));
    for (int i = 0; i < 25; i++) k4[i] = (uint8_t)(i + 1);
    memset(d4, 0xcd, sizeof(d4));
    memset(k5, 0x0c, sizeof(k5));
    memset(k6, 0xaa, sizeof(k6));

    xccl_hmac_sha256(k1, sizeof(k1), "Hi There", 8, out);
    hex(out, 32, h);
    CHECK(strcmp(h, "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7") == 0);
    xccl_hmac_sha256("Jefe", 4, "what do ya want for nothing?", 28, out);
    hex(out, 32, h);
    CHECK(strcmp(h, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843") == 0);
    xccl_hmac_sha256(k3, sizeof(k3), d3, sizeof(d3), out);
    hex(out, 32, h);
    CHECK(strcmp(h, "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe") == 0);
    xccl_hmac_sha256(k4, sizeof(k4), d4, sizeof(d4), out);
    hex(out, 32, h);
    CHECK(strcmp(h, "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b") == 0);
    xccl_hmac_sha256(k5, sizeof(k5), "Test With Truncation", 20, out);
    hex(out, 16, h); /* case 5 publishes the first 128 bits */
    CHECK(strcmp(h, "a3b6167473100ee06e0c796c2955552b") == 0);
    xccl_hmac_sha256(k6, sizeof(k6), m6, strlen(m6), out);
    hex(out, 32, h);
    CHECK(strcmp(h, "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54") == 0);
    xccl_hmac_sha256(k6, sizeof(k6), m7, strlen(m7), out);
    hex(out, 32, h);
    CHECK(strcmp(h, "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2") == 0);
}

static void test_helpers(void)
{
    uint8_t a[XCCL_NONCE_LEN], b[XCCL_NONCE_LEN], zero[XCCL_NONCE_LEN] = {0};
    uint8_t n1[XCCL_NONCE_LEN], n2[XCCL_NONCE_LEN];
    uint8_t proof[XCCL_SHA256_LEN], want[XCCL_SHA256_LEN];
    uint8_t msg[1 + 2 * XCCL_NONCE_LEN + 10];

    CHECK(xccl_random_bytes(a, sizeof(a)) == XCCL_OK);
    CHECK(xccl_random_bytes(b, sizeof(b)) == XCCL_OK);
    CHECK(memcmp(a, b, sizeof(a)) != 0);
    CHECK(memcmp(a, zero, sizeof(a)) != 0);

    CHECK(xccl_ct_equal(a, a, sizeof(a)) == 1);
    memcpy(b, a, sizeof(a));
    b[31] ^= 0x80;
    CHECK(xccl_ct_equal(a, b, sizeof(a)) == 0);
    b[31] ^= 0x80;
    b[0] ^= 1;
    CHECK(xccl_ct_equal(a, b, sizeof(a)) == 0);
    CHECK(xccl_ct_equal(a, b, 0) == 1);

    /* proof = HMAC(key, role || nonce_self || nonce_peer || context) */
    memset(n1, 0x11, sizeof(n1));
    memset(n2, 0x22, sizeof(n2));
    xccl_auth_proof("secret", 6, XCCL_AUTH_ROLE_SERVER, n1, n2, "xccl-store", 10, proof);
    msg[0] = XCCL_AUTH_ROLE_SERVER;
    memcpy(msg + 1, n1, sizeof(n1));
    memcpy(msg + 1 + sizeof(n1), n2, sizeof(n2));
    memcpy(msg + 1 + 2 * XCCL_NONCE_LEN, "xccl-store", 10);
    xccl_hmac_sha256("secret", 6, msg, sizeof(msg), want);
    CHECK(memcmp(proof, want, sizeof(want)) == 0);
    /* roles separate the directions */
    xccl_auth_proof("secret", 6, XCCL_AUTH_ROLE_CLIENT, n1, n2, "xccl-store", 10, want);
    CHECK(memcmp(proof, want, sizeof(want)) != 0);
}

typedef struct side {
    int           fd;
    const char   *key;
    const char   *context;
    int           is_server;
    int64_t       timeout_ms;
    xccl_status_t st;
} side_t;

static void *run_side(void *arg)
{
    side_t *s = arg;
    s->st = xccl_auth_handshake(s->fd, s->key, strlen(s->key), s->is_server, s->context,
                                xccl_now_ms() + s->timeout_ms);
    return NULL;
}

/* Runs both sides over a socketpair; returns the two statuses. */
static void handshake(const char *kc, const char *ks, const char *cc, const char *cs,
                      xccl_status_t *client, xccl_status_t *server)
{
    int       sv[2];
    pthread_t th;
    side_t    c = {0}, s = {0};

    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    c = (side_t){sv[0], kc, cc, 0, 2000, XCCL_OK};
    s = (side_t){sv[1], ks, cs, 1, 2000, XCCL_OK};
    pthread_create(&th, NULL, run_side, &s);
    run_side(&c);
    /* a side that failed closes, so the other one cannot hang on it */
    if (c.st != XCCL_OK) shutdown(sv[0], SHUT_RDWR);
    pthread_join(th, NULL);
    close(sv[0]);
    close(sv[1]);
    *client = c.st;
    *server = s.st;
}

static void test_handshake(void)
{
    xccl_status_t c, s;
    int           sv[2];
    side_t        one;
    int64_t       t0;
    uint8_t       junk[XCCL_AUTH_HELLO_LEN];

    handshake("k3y", "k3y", "xccl-store", "xccl-store", &c, &s);
    CHECK(c == XCCL_OK && s == XCCL_OK);
    handshake("k3y", "other", "xccl-store", "xccl-store", &c, &s);
    CHECK_MSG(c == XCCL_ERR_AUTH && s == XCCL_ERR_AUTH, "wrong key: %d %d", c, s);
    handshake("k3y", "k3y", "xccl-store", "xccl-tcp/1", &c, &s);
    CHECK_MSG(c == XCCL_ERR_AUTH && s == XCCL_ERR_AUTH, "wrong context: %d %d", c, s);
    /* a long key (hashed first) works the same on both sides */
    {
        char big[300];
        memset(big, 'k', sizeof(big) - 1);
        big[sizeof(big) - 1] = '\0';
        handshake(big, big, "ctx", "ctx", &c, &s);
        CHECK(c == XCCL_OK && s == XCCL_OK);
    }

    /* a peer that sends something other than a hello */
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    memset(junk, 'G', sizeof(junk));
    CHECK(write(sv[1], junk, sizeof(junk)) == (ssize_t)sizeof(junk));
    one = (side_t){sv[0], "k", "ctx", 0, 1000, XCCL_OK};
    run_side(&one);
    CHECK(one.st == XCCL_ERR_AUTH);
    CHECK(strstr(xccl_last_error(), "auth hello") != NULL);
    close(sv[0]);
    close(sv[1]);

    /* a peer that closes */
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    close(sv[1]);
    one = (side_t){sv[0], "k", "ctx", 1, 1000, XCCL_OK};
    run_side(&one);
    CHECK(one.st == XCCL_ERR_REMOTE);
    close(sv[0]);

    /* a silent peer: the deadline holds */
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    one = (side_t){sv[0], "k", "ctx", 0, 150, XCCL_OK};
    t0  = xccl_now_ms();
    run_side(&one);
    CHECK(one.st == XCCL_ERR_TIMEOUT);
    CHECK(xccl_now_ms() - t0 >= 140 && xccl_now_ms() - t0 < 2000);
    close(sv[0]);
    close(sv[1]);
}

int main(void)
{
    test_sha256();
    test_hmac();
    test_helpers();
    test_handshake();
    CTEST_MAIN_END("test_auth");
}
