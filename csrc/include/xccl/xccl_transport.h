/* SPDX-License-Identifier: Apache-2.0
 *
 * xccl_transport.h - the transport ABI: what a transport (tcp, shm, cuda_ipc, ibverbs) provides
 * to the core, and what the core provides back. Transports move messages between processes;
 * they never know what a collective is. The core does tag matching, so any-source receives,
 * mismatch checks and unexpected messages work the same over every transport.
 *
 * Model
 *   A message is a fixed header (xccl_msg_hdr_t) followed by hdr.nbytes of payload. Messages
 *   from one peer are delivered in the order they were posted to that peer. On the receive side
 *   the transport hands each header to the core (upcall recv_match); the core answers with the
 *   destination buffer (a posted receive's buffer, or a staging buffer for an unexpected message)
 *   and the transport writes the payload there, then calls recv_done. A transport may deliver the
 *   payload any way it likes: streamed from a socket, copied from a shared-memory ring, pulled
 *   with process_vm_readv or an RDMA read after the match, etc.
 *
 * Threading
 *   A transport context is driven by one thread at a time: the core serialises every call into
 *   a context (and every upcall out of it) under its own lock. Only `wait`, `wait_arm` and
 *   `wait_disarm` are called without that lock and may run concurrently with other calls (and
 *   with each other, from several threads); they must only sleep or prepare a sleep.
 *
 * Sleeping
 *   With one transport in a context the core sleeps in its `wait`. With several it sleeps on all
 *   at once: it arms each (wait_arm), polls the descriptors they give for POLLIN in one poll(2),
 *   then disarms each (wait_disarm). A descriptor must turn readable whenever `wait` would
 *   return: a message or completion to progress, a `wake`.
 *
 * Wire-up data
 *   Each rank publishes one address blob per transport (get_addr, at most XCCL_TP_ADDR_MAX
 *   bytes): per-rank data. Data per pair of ranks (e.g. the queue-pair numbers of a
 *   connection-per-peer transport, which grow with the job and do not fit a fixed blob) goes
 *   through the key-value view of the bootstrap store that init's params give (kv), scoped to
 *   this context and the transport: keys never collide with the core's or another transport's.
 *   The store is the job's authenticated channel (its TCP server admits only clients that know
 *   the job secret), so such data travels under the job's authentication.
 *
 * Versioning
 *   abi_version must equal XCCL_TRANSPORT_ABI_VERSION (5 added xccl_tp_init_params_t.kv). New entries are appended; optional
 *   entries may be NULL.
 *
 * Building a transport
 *   A transport needs only the public headers: this one, xccl.h and xccl_tp_support.h (errors,
 *   logging, clocks, sockets, the authentication handshake). The built-in ones (tcp, shm) are
 *   built that way; a transport built elsewhere is added with xccl_transport_register.
 */
#ifndef XCCL_TRANSPORT_H
#define XCCL_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>

#include "xccl/xccl.h"

#ifdef __cplusplus
extern "C" {
#endif

#define XCCL_TRANSPORT_ABI_VERSION 5
#define XCCL_TP_ADDR_MAX           256 /* bytes of address blob per rank and transport */
#define XCCL_TP_NAME_MAX           16  /* bytes of a transport's name, NUL included     */
#define XCCL_CPU_WORDS             16  /* xccl_peer_info_t.cpus: CPUs 0..1023           */

/* Wire header of every message (host byte order; peers are assumed to share endianness, which
 * the TCP handshake verifies). 32 bytes. */
typedef struct xccl_msg_hdr {
    uint64_t comm_id; /* communicator the message belongs to                                */
    uint64_t tag;     /* match key within the communicator (opaque to transports)            */
    uint64_t fp;      /* fingerprint of the call that sent it (0 for point-to-point)         */
    uint64_t nbytes;  /* payload bytes that follow                                           */
} xccl_msg_hdr_t;

/* A buffer as the core hands it to a transport. `mr` is the transport's registration handle
 * for transports with XCCL_TP_CAP_NEEDS_REG (NULL otherwise, or when not registered yet). */
typedef struct xccl_tp_buf {
    void           *ptr;
    xccl_mem_type_t mem;
    void           *mr;
} xccl_tp_buf_t;

/* What the core knows about a process, exchanged through the store before wire-up. */
typedef struct xccl_peer_info {
    uint64_t host_id; /* equal on the same host and kernel (boot id + hostname hash)         */
    int32_t  pid;
    int32_t  cuda_dev; /* -1 without a GPU                                                   */
    uint64_t ipc_ns;   /* IPC namespace inode: shared memory is usable only when equal       */
    uint64_t cpus[XCCL_CPU_WORDS]; /* CPUs it may run on (affinity mask, bit c: CPU c)   */
} xccl_peer_info_t;

/* Calls from a transport back into the core. All are made from inside `progress`, `isend`
 * or `wireup`, with the core's lock held; they never block. */
typedef struct xccl_tp_upcalls {
    void *core;
    /* A header from `peer` arrived. On XCCL_OK, *dst says where the hdr->nbytes of payload go
     * (dst->ptr NULL with nbytes > 0: the payload is not wanted - the transport consumes and
     * drops it without storing it, then calls recv_done as usual); *cookie is passed to
     * recv_done. A negative
     * status means the message is refused (the transport drops the payload and reports the
     * peer as failed). XCCL_INPROGRESS, only to transports with XCCL_TP_CAP_DEFER: nothing
     * is posted for this message yet and the core would rather wait a little than stage it
     * (an extra copy into a fresh buffer); the transport keeps the header, takes nothing more
     * from that peer and asks again on each progress pass until the answer is final. */
    xccl_status_t (*recv_match)(void *core, int peer, const xccl_msg_hdr_t *hdr,
                                xccl_tp_buf_t *dst, void **cookie);
    /* The payload of a matched message is in place (st == XCCL_OK) or will never arrive. */
    void (*recv_done)(void *core, void *cookie, xccl_status_t st);
    /* A send posted with isend has left the buffer (st == XCCL_OK; the buffer may be reused)
     * or has failed. */
    void (*send_done)(void *core, void *cookie, xccl_status_t st);
    /* The connection to `peer` broke. `why` names the cause. Sends to and receives from that
     * peer still pending in the transport are failed through send_done/recv_done first. */
    void (*peer_failed)(void *core, int peer, xccl_status_t st, const char *why);
} xccl_tp_upcalls_t;

/* A key-value view of the bootstrap store, scoped to one context and one transport (the core
 * prefixes every key with the context's generation and the transport's name). Valid from init
 * until wireup returns (or, when wireup is never called, until finalize): a transport must not
 * keep it beyond. Both calls block (at most timeout_ms for get); they are made without
 * progress running, from init or wireup only.
 *   put: stores len bytes under key (overwriting). Keys are NUL-terminated, at most 96 bytes.
 *   get: waits until key exists or timeout_ms passes (XCCL_ERR_TIMEOUT; 0: test once); on
 *        XCCL_OK *val is a malloc'd copy (free() it) of *len bytes. */
typedef struct xccl_tp_kv {
    void *core;
    xccl_status_t (*put)(void *core, const char *key, const void *val, size_t len);
    xccl_status_t (*get)(void *core, const char *key, int64_t timeout_ms, void **val,
                         size_t *len);
} xccl_tp_kv_t;

typedef struct xccl_tp_init_params {
    int                      rank;   /* rank in the context (the world communicator)        */
    int                      size;
    uint64_t                 job_id; /* identical on every rank of the context             */
    const xccl_peer_info_t  *peers;  /* size entries, peers[rank] is this process          */
    const void              *auth_key; /* NULL: no authentication                          */
    size_t                   auth_key_len;
    const xccl_tp_upcalls_t *up;
    /* this host runs more ranks of the job than the CPUs they may run on together (the core
     * counts both from `peers`): a transport may trade copies for CPU time */
    int                      cpus_scarce;
    /* the bootstrap store's view for this transport (see xccl_tp_kv_t); NULL when the caller
     * has none (a transport that needs it then answers XCCL_ERR_NOT_SUPPORTED) */
    const xccl_tp_kv_t      *kv;
} xccl_tp_init_params_t;

typedef struct xccl_tp_ctx xccl_tp_ctx_t; /* transport-private per-context state */

enum {
    XCCL_TP_CAP_HOST_MEM   = 1u << 0, /* data path accepts host memory                       */
    XCCL_TP_CAP_CUDA_MEM   = 1u << 1, /* data path accepts device memory                     */
    XCCL_TP_CAP_NEEDS_REG  = 1u << 2, /* buffers must be registered with mem_reg first       */
    XCCL_TP_CAP_INTRA_HOST = 1u << 3, /* reaches peers on the same host only                 */
    /* large payloads are copied by the receiver straight from the sender's memory (e.g.
     * cross-memory attach), so the receivers of one sender copy in parallel */
    XCCL_TP_CAP_RECV_PULL  = 1u << 4,
    /* can hold a message back when recv_match answers XCCL_INPROGRESS (see there) */
    XCCL_TP_CAP_DEFER      = 1u << 5,
};

typedef struct xccl_transport_ops {
    uint32_t    abi_version; /* XCCL_TRANSPORT_ABI_VERSION                                    */
    const char *name;        /* "tcp", "shm", ... (used by XCCL_TRANSPORTS; < XCCL_TP_NAME_MAX) */
    uint32_t    caps;        /* XCCL_TP_CAP_* bits                                            */
    int         priority;    /* among transports that reach a peer, the highest is used       */

    /* Creates the per-context state and any listening endpoint. XCCL_ERR_NOT_SUPPORTED means
     * "not usable on this machine" (e.g. a library is missing) and is not an error; the
     * transport then records why with xccl_error_set ("no RDMA device", ...), which the core
     * logs at INFO and puts in its error when no transport asked for is usable. */
    xccl_status_t (*init)(const xccl_tp_init_params_t *params, xccl_tp_ctx_t **ctx);
    /* Closes every connection and frees the context. Never waits for peers. */
    void (*finalize)(xccl_tp_ctx_t *ctx);
    /* 1 if this transport can carry messages to `peer` (a pure function of the infos). */
    int (*reachable)(const xccl_tp_ctx_t *ctx, int peer);
    /* Writes this rank's address blob (at most XCCL_TP_ADDR_MAX bytes) for the store. */
    xccl_status_t (*get_addr)(xccl_tp_ctx_t *ctx, void *addr, size_t *len);
    /* Connects to every peer p with use[p] != 0, given every rank's address blob. Blocks up to
     * timeout_ms; on timeout fails naming the peers that are not connected. Connections are
     * authenticated (when a key is set) and checked for job id, rank and protocol version;
     * anything else is refused and logged without disturbing the job. */
    xccl_status_t (*wireup)(xccl_tp_ctx_t *ctx, const void *const *addrs, const size_t *lens,
                            const uint8_t *use, int64_t timeout_ms);

    /* Queues a message to `peer`; never blocks. The buffer must stay untouched until
     * send_done(cookie). Messages to one peer leave in posting order. */
    xccl_status_t (*isend)(xccl_tp_ctx_t *ctx, int peer, const xccl_msg_hdr_t *hdr,
                           const xccl_tp_buf_t *buf, void *cookie);
    /* Advances every connection once without blocking; *nevents counts messages and
     * completions handled (0 means nothing happened). */
    xccl_status_t (*progress)(xccl_tp_ctx_t *ctx, int *nevents);
    /* Optional: sleeps until this transport may have something to do or timeout_ms passes.
     * Called without the core lock (see Threading). NULL: the core sleeps on its own. */
    void (*wait)(xccl_tp_ctx_t *ctx, int timeout_ms);
    /* Optional: wakes a thread sleeping in `wait` or polling wait_arm's descriptor. */
    void (*wake)(xccl_tp_ctx_t *ctx);

    /* Optional: drops the connection to `peer` now (the core gives up on an operation that
     * timed out while the transport still held its buffers). Pending sends and receives of
     * that peer are failed through the upcalls before it returns, then peer_failed is called.
     * NULL: the core waits for the transport to finish them. */
    void (*close_peer)(xccl_tp_ctx_t *ctx, int peer, const char *why);

    /* Optional (XCCL_TP_CAP_NEEDS_REG): memory registration. */
    xccl_status_t (*mem_reg)(xccl_tp_ctx_t *ctx, void *ptr, size_t nbytes, xccl_mem_type_t mem,
                             void **mr);
    void (*mem_dereg)(xccl_tp_ctx_t *ctx, void *mr);

    /* Optional (0: the core's defaults): the α-β model of one message on this transport,
     * seconds per message and seconds per byte, which the core uses to choose algorithms
     * for communicators whose links are of this transport. */
    double alpha;
    double beta;

    /* Optional, for a context with several transports (see Sleeping): prepares a sleep.
     * 0: this transport has something to do now; the core does not sleep and does not disarm
     * it. 1: armed, and *fd is a descriptor to poll for POLLIN, or -1 when it has none (the
     * core then sleeps at most 1 ms). NULL: the core sleeps at most 1 ms at a time. */
    int (*wait_arm)(xccl_tp_ctx_t *ctx, int *fd);
    /* Optional: undoes a wait_arm that returned 1, after the poll. */
    void (*wait_disarm)(xccl_tp_ctx_t *ctx);
} xccl_transport_ops_t;

/* Adds a transport to those every later context chooses from (XCCL_TRANSPORTS names it, or its
 * priority ranks it among the others); a context created before does not see it. `ops` must
 * stay valid until the process exits; it cannot be removed. Thread-safe, but a registration
 * racing with a communicator's creation may or may not be seen by it.
 * XCCL_ERR_INVALID_ARG: abi_version is not XCCL_TRANSPORT_ABI_VERSION, a mandatory entry (init,
 * finalize, reachable, get_addr, wireup, isend, progress; mem_reg and mem_dereg with
 * XCCL_TP_CAP_NEEDS_REG) is NULL, or the name is empty, too long or already taken.
 * XCCL_ERR_NOT_SUPPORTED: no room for another transport (XCCL_TP_REGISTER_MAX). */
#define XCCL_TP_REGISTER_MAX 2
xccl_status_t xccl_transport_register(const xccl_transport_ops_t *ops);
/* The transport named `name`, built in or registered; NULL if there is none. A transport may
 * wrap another (e.g. tcp) by calling its entries with its own state. */
const xccl_transport_ops_t *xccl_transport_find(const char *name);

#ifdef __cplusplus
}
#endif
#endif /* XCCL_TRANSPORT_H */
