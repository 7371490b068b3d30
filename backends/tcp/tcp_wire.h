/* SPDX-License-Identifier: Apache-2.0
 *
 * tcp_wire.h - what the TCP transport puts on the wire besides messages: the address blob
 * published through the store, and the connection handshake. Tests include it to play rogue
 * peers.
 *
 * Connection set-up (rank i connects to every used rank j < i; j accepts):
 *
 *   connector i                               acceptor j
 *   ---------------------------------------   ----------------------------------------------
 *   connect (retried with backoff)            accept (listening socket, non-blocking)
 *   send tcp_hello_t                   --->   check magic (first 4 bytes), endianness,
 *                                             version, job id, ranks, "expected and not yet
 *                                             connected", auth mode
 *                                      <---   tcp_ack_t (status 0, or the refusal reason,
 *                                             then close)
 *   [both, when a key is set: xccl_auth_handshake, context "xccl-tcp/<job id, 16 hex>";
 *    the connector is the client, the acceptor the server; failure closes the socket]
 *   messages: xccl_msg_hdr_t + payload, in both directions, until either side closes.
 *
 * The acceptor never trusts a connection before its hello checks out (and the proof, with a
 * key): anything else is closed, logged with the remote address and the reason, and the
 * job goes on accepting.
 */
#ifndef XCCL_BACKENDS_TCP_WIRE_H
#define XCCL_BACKENDS_TCP_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "xccl/xccl_tp_support.h" /* xccl_sockaddr_t */

#define TCP_PROTO_VERSION 1
#define TCP_MAGIC         "XTCP"  /* first 4 bytes of tcp_hello_t and tcp_ack_t          */
#define TCP_ENDIAN_MARK   0x0102u /* as the sender's uint16_t stores it                   */
#define TCP_HELLO_AUTH    1u      /* tcp_hello_t.flags: the connector authenticates next */

/* Address blob (TCP_ADDR_LEN bytes, byte-exact, multi-byte fields big-endian):
 *   offset  size  field
 *        0     4  "XTCA"
 *        4     1  address family: 4 or 6
 *        5     1  reserved, 0
 *        6     2  listening port
 *        8     4  IPv6 scope id (0 for IPv4)
 *       12    16  address (IPv4: first 4 bytes, rest 0)                                   */
#define TCP_ADDR_MAGIC "XTCA"
#define TCP_ADDR_LEN   28

/* Connector -> acceptor, 32 bytes, in the connector's byte order (the endian field tells). */
typedef struct tcp_hello {
    char     magic[4]; /* TCP_MAGIC                                                    */
    uint16_t version;  /* TCP_PROTO_VERSION                                            */
    uint16_t endian;   /* TCP_ENDIAN_MARK                                              */
    uint64_t job_id;
    int32_t  src_rank; /* the connector                                                */
    int32_t  dst_rank; /* the rank it means to reach                                   */
    uint32_t flags;    /* TCP_HELLO_AUTH                                               */
    uint32_t reserved; /* 0                                                            */
} tcp_hello_t;

/* Acceptor -> connector, 24 bytes. */
typedef struct tcp_ack {
    char     magic[4]; /* TCP_MAGIC                                                    */
    uint16_t version;  /* the acceptor's TCP_PROTO_VERSION                             */
    uint16_t status;   /* TCP_ACK_*                                                    */
    uint64_t job_id;   /* the acceptor's                                               */
    int32_t  rank;     /* the acceptor's                                               */
    uint32_t reserved; /* 0                                                            */
} tcp_ack_t;

/* tcp_ack_t.status: 0 accepts; anything else is the reason for closing. */
enum {
    TCP_ACK_OK         = 0,
    TCP_ACK_VERSION    = 1, /* protocol version differs                                */
    TCP_ACK_ENDIAN     = 2, /* byte order differs                                      */
    TCP_ACK_JOB        = 3, /* job id differs                                          */
    TCP_ACK_RANK       = 4, /* src out of range, or dst is not the acceptor            */
    TCP_ACK_UNEXPECTED = 5, /* the acceptor does not expect this rank to connect       */
    TCP_ACK_DUPLICATE  = 6, /* this rank is already connected                          */
    TCP_ACK_AUTH_MODE  = 7, /* one side has a key and the other does not               */
};

_Static_assert(sizeof(tcp_hello_t) == 32, "tcp_hello_t is 32 bytes on the wire");
_Static_assert(sizeof(tcp_ack_t) == 24, "tcp_ack_t is 24 bytes on the wire");

/* The parsers of what other processes send (tcp_wire.c; tests/fuzz drives them). */

/* Encodes a (listening) address into its blob; decodes one: 0, or -1 if it is malformed. */
void xccl_tcp_addr_encode(const xccl_sockaddr_t *a, uint8_t out[TCP_ADDR_LEN]);
int  xccl_tcp_addr_decode(const void *blob, size_t len, xccl_sockaddr_t *a);

/* Acceptor `rank` of `size` in job `job_id`: TCP_ACK_OK if hello h may be adopted, else the
 * refusal to send. use[s]: rank s is expected to connect (size entries); busy(arg, s): s is
 * connected or connecting already (asked only for an expected s). */
unsigned xccl_tcp_hello_check(const tcp_hello_t *h, int rank, int size, uint64_t job_id,
                              const uint8_t *use, int has_key, int (*busy)(void *arg, int src),
                              void *arg);

/* Connector: 0 if ack a (from `peer`) accepts us; -1 if it is no xccl tcp ack at all; 1 if it
 * refuses us or is not the acceptor we meant, with the reason in why. */
int xccl_tcp_ack_check(const tcp_ack_t *a, uint64_t job_id, int peer, char *why, size_t len);

/* "protocol version differs", ... for a TCP_ACK_* status. */
const char *xccl_tcp_ack_reason(unsigned status);

#endif /* XCCL_BACKENDS_TCP_WIRE_H */
