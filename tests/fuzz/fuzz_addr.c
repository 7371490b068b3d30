/* SPDX-License-Identifier: Apache-2.0
 *
 * fuzz_addr.c - the address records ranks publish through the store, read as another rank reads
 * them: the record (csrc/core/ctx.c, xccl_addr_rec_parse), then each transport's blob by the
 * transport it names (backends/tcp/tcp_wire.c, backends/shm/shm_wire.c). The input is the
 * store value.
 *
 * Checked beyond "no crash": an accepted record has at most XCCL_MAX_TRANSPORTS entries whose
 * names are NUL-terminated and whose blobs lie, in order and without overlap, inside the value
 * and within XCCL_TP_ADDR_MAX; an accepted tcp blob re-encodes to the same family, port,
 * scope and address bytes (the round trip is exact for every field the format defines); an
 * accepted shm blob has its magic, version and a terminated name.
 */
#include "fuzz.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include "core/core.h"

#include "../../backends/shm/shm_layout.h"
#include "../../backends/tcp/tcp_wire.h"

static void check_tcp_blob(const uint8_t *b, size_t len)
{
    xccl_sockaddr_t a, again;
    uint8_t         enc[TCP_ADDR_LEN];

    if (xccl_tcp_addr_decode(b, len, &a) != 0) return;
    FUZZ_CHECK(len == TCP_ADDR_LEN && memcmp(b, TCP_ADDR_MAGIC, 4) == 0 && (b[4] == 4 || b[4] == 6),
               "tcp blob accepted: length %zu, family byte %u", len, b[4]);
    xccl_tcp_addr_encode(&a, enc);
    FUZZ_CHECK(memcmp(enc, b, 5) == 0 && memcmp(enc + 6, b + 6, 2) == 0,
               "tcp blob: magic, family or port differ after a round trip");
    if (b[4] == 4) {
        FUZZ_CHECK(a.ss.ss_family == AF_INET && a.len == sizeof(struct sockaddr_in) &&
                       memcmp(enc + 12, b + 12, 4) == 0,
                   "tcp blob: IPv4 address differs after a round trip");
    } else {
        FUZZ_CHECK(a.ss.ss_family == AF_INET6 && a.len == sizeof(struct sockaddr_in6) &&
                       memcmp(enc + 8, b + 8, 20) == 0,
                   "tcp blob: IPv6 scope or address differs after a round trip");
    }
    FUZZ_CHECK(xccl_tcp_addr_decode(enc, sizeof(enc), &again) == 0 && again.len == a.len &&
                   memcmp(&again.ss, &a.ss, a.len) == 0,
               "tcp blob: decode(encode(x)) != x");
}

static void check_shm_blob(const uint8_t *b, size_t len)
{
    shm_addr_t a;

    if (xccl_shm_addr_decode(b, len, &a) != 0) return;
    FUZZ_CHECK(len == SHM_ADDR_LEN && memcmp(a.magic, SHM_ADDR_MAGIC, 4) == 0 &&
                   a.version == SHM_VERSION,
               "shm blob accepted with length %zu", len);
    FUZZ_CHECK(memchr(a.name, '\0', sizeof(a.name)) != NULL, "shm blob: name not terminated");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    xccl_addr_rec_t r;
    uint8_t        *copy = malloc(size ? size : 1); /* exactly size bytes: ASan sees overreads */
    const uint8_t  *end;
    const uint8_t  *prev = NULL;

    FUZZ_CHECK(copy != NULL, "out of memory");
    if (size) memcpy(copy, data, size);
    end = copy + size;
    memset(&r, 0xa5, sizeof(r));
    if (xccl_addr_rec_parse(copy, size, 3, &r) == XCCL_OK) {
        FUZZ_CHECK(r.ntp >= 0 && r.ntp <= XCCL_MAX_TRANSPORTS, "ntp %d", r.ntp);
        for (int i = 0; i < r.ntp; i++) {
            const uint8_t *b = r.blobs[i];
            FUZZ_CHECK(memchr(r.names[i], '\0', sizeof(r.names[i])) != NULL,
                       "name %d not terminated", i);
            FUZZ_CHECK(r.lens[i] <= XCCL_TP_ADDR_MAX, "blob %d of %zu bytes", i, r.lens[i]);
            FUZZ_CHECK(b >= copy + 4 + 20 && b <= end && r.lens[i] <= (size_t)(end - b),
                       "blob %d outside the value", i);
            FUZZ_CHECK(prev == NULL || b >= prev + 20, "blob %d overlaps the one before", i);
            prev = b + r.lens[i];
            if (strcmp(r.names[i], "tcp") == 0) check_tcp_blob(b, r.lens[i]);
            if (strcmp(r.names[i], "shm") == 0) check_shm_blob(b, r.lens[i]);
        }
    }
    /* the blob decoders also on the raw value, as a transport given a bad blob would be */
    check_tcp_blob(copy, size);
    check_shm_blob(copy, size);
    free(copy);
    return 0;
}
