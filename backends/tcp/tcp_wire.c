/* SPDX-License-Identifier: Apache-2.0
 *
 * tcp_wire.c - the TCP transport's parsers of what other processes send (tcp_wire.h): the
 * address blob read from the store, the connector's hello and the acceptor's ack. No sockets
 * and no context here, so that tests/fuzz drives exactly the code tcp.c runs.
 */
#include "tcp_wire.h"

#include <arpa/inet.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>

const char *xccl_tcp_ack_reason(unsigned status)
{
    switch (status) {
    case TCP_ACK_OK: return "accepted";
    case TCP_ACK_VERSION: return "protocol version differs";
    case TCP_ACK_ENDIAN: return "byte order differs";
    case TCP_ACK_JOB: return "job id differs";
    case TCP_ACK_RANK: return "rank out of range or not the one addressed";
    case TCP_ACK_UNEXPECTED: return "that rank is not expected to connect here";
    case TCP_ACK_DUPLICATE: return "that rank is already connected";
    case TCP_ACK_AUTH_MODE: return "one side has an auth key and the other does not";
    }
    return "unknown reason";
}

void xccl_tcp_addr_encode(const xccl_sockaddr_t *a, uint8_t out[TCP_ADDR_LEN])
{
    memset(out, 0, TCP_ADDR_LEN);
    memcpy(out, TCP_ADDR_MAGIC, 4);
    if (a->ss.ss_family == AF_INET) {
        const struct sockaddr_in *s4 = (const struct sockaddr_in *)&a->ss;
        out[4] = 4;
        memcpy(out + 6, &s4->sin_port, 2); /* already big-endian */
        memcpy(out + 12, &s4->sin_addr, 4);
    } else {
        const struct sockaddr_in6 *s6    = (const struct sockaddr_in6 *)&a->ss;
        uint32_t                   scope = htonl(s6->sin6_scope_id);
        out[4] = 6;
        memcpy(out + 6, &s6->sin6_port, 2);
        memcpy(out + 8, &scope, 4);
        memcpy(out + 12, &s6->sin6_addr, 16);
    }
}

int xccl_tcp_addr_decode(const void *blob, size_t len, xccl_sockaddr_t *a)
{
    const uint8_t *in = blob;

    if (blob == NULL || len != TCP_ADDR_LEN || memcmp(in, TCP_ADDR_MAGIC, 4) != 0) return -1;
    memset(a, 0, sizeof(*a));
    if (in[4] == 4) {
        struct sockaddr_in *s4 = (struct sockaddr_in *)&a->ss;
        s4->sin_family         = AF_INET;
        memcpy(&s4->sin_port, in + 6, 2);
        memcpy(&s4->sin_addr, in + 12, 4);
        a->len = sizeof(*s4);
    } else if (in[4] == 6) {
        struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&a->ss;
        uint32_t             scope;
        s6->sin6_family = AF_INET6;
        memcpy(&s6->sin6_port, in + 6, 2);
        memcpy(&scope, in + 8, 4);
        s6->sin6_scope_id = ntohl(scope);
        memcpy(&s6->sin6_addr, in + 12, 16);
        a->len = sizeof(*s6);
    } else {
        return -1;
    }
    return 0;
}

unsigned xccl_tcp_hello_check(const tcp_hello_t *h, int rank, int size, uint64_t job_id,
                              const uint8_t *use, int has_key, int (*busy)(void *arg, int src),
                              void *arg)
{
    int src = h->src_rank;

    if (h->endian != TCP_ENDIAN_MARK) return TCP_ACK_ENDIAN;
    if (h->version != TCP_PROTO_VERSION) return TCP_ACK_VERSION;
    if (h->job_id != job_id) return TCP_ACK_JOB;
    if (h->dst_rank != rank || src < 0 || src >= size) return TCP_ACK_RANK;
    if (src <= rank || !use[src]) return TCP_ACK_UNEXPECTED;
    if (busy(arg, src)) return TCP_ACK_DUPLICATE;
    if (!!(h->flags & TCP_HELLO_AUTH) != (has_key != 0)) return TCP_ACK_AUTH_MODE;
    return TCP_ACK_OK;
}

int xccl_tcp_ack_check(const tcp_ack_t *a, uint64_t job_id, int peer, char *why, size_t len)
{
    if (memcmp(a->magic, TCP_MAGIC, 4) != 0) return -1;
    if (a->status != TCP_ACK_OK)
        snprintf(why, len, "it refused us: %s", xccl_tcp_ack_reason(a->status));
    else if (a->version != TCP_PROTO_VERSION)
        snprintf(why, len, "protocol version %u, ours is %u", a->version, TCP_PROTO_VERSION);
    else if (a->job_id != job_id)
        snprintf(why, len, "job id %" PRIx64 ", ours is %" PRIx64, a->job_id, job_id);
    else if (a->rank != peer)
        snprintf(why, len, "it is rank %d", (int)a->rank);
    else
        return 0;
    return 1;
}
