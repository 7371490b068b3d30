/* SPDX-License-Identifier: Apache-2.0
 *
 * xccl.h - the public C API of xccl: status codes, data types, reduction operators, key/value
 * stores, communicators, Work handles, point-to-point and collective operations.
 *
 * Conventions
 *   - Every function that can fail returns xccl_status_t: 0 is success, XCCL_INPROGRESS (> 0)
 *     means "not finished, not an error", negative values are errors. On error a human-readable
 *     message is available from xccl_last_error() in the calling thread (and, for operations,
 *     from xccl_work_error()).
 *   - `count` is always a number of elements, `nbytes` a number of bytes.
 *   - Nothing here prints to stdout, calls exit() or abort().
 *   - Thread safety: stores and communicators may be used from several threads at once. A
 *     single Work may be waited on by one thread at a time.
 */
#ifndef XCCL_H
#define XCCL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define XCCL_VERSION_MAJOR 0
#define XCCL_VERSION_MINOR 1
#define XCCL_VERSION_PATCH 0

/* ---------------------------------------------------------------------------------------------
 * Status
 * ------------------------------------------------------------------------------------------- */
typedef enum xccl_status {
    XCCL_OK                = 0,
    XCCL_INPROGRESS        = 1,   /* posted, not complete; not an error                        */
    XCCL_ERR_INVALID_ARG   = -1,  /* bad value from the caller                                 */
    XCCL_ERR_INVALID_USAGE = -2,  /* wrong call order, receive buffer too small, closed comm   */
    XCCL_ERR_NOT_SUPPORTED = -3,  /* dtype/op/device/transport not available                   */
    XCCL_ERR_NO_MEMORY     = -4,
    XCCL_ERR_SYSTEM        = -5,  /* a system call failed; errno text is in the message        */
    XCCL_ERR_REMOTE        = -6,  /* a peer closed its connection or reported a failure        */
    XCCL_ERR_TIMEOUT       = -7,
    XCCL_ERR_CUDA          = -8,
    XCCL_ERR_ABORTED       = -9,  /* the communicator was aborted or destroyed                 */
    XCCL_ERR_INTERNAL      = -10, /* an invariant of xccl itself was violated                  */
    XCCL_ERR_MISMATCH      = -11, /* ranks called different collectives (or sizes, roots...)  */
    XCCL_ERR_AUTH          = -12, /* a peer failed authentication or the handshake             */
} xccl_status_t;

/* "XCCL_ERR_TIMEOUT" etc. Never NULL. */
const char *xccl_status_string(xccl_status_t st);
/* The message of the last error reported in the calling thread ("" if none). */
const char *xccl_last_error(void);
/* Frees memory returned by xccl (store values). */
void xccl_free(void *p);
/* Records `msg` as the calling thread's last error (what xccl_last_error() returns) and
 * returns `st`. For code that implements xccl callbacks outside the library (a custom store
 * written in another language) so that its failures carry a message. Does not log. */
xccl_status_t xccl_set_error(xccl_status_t st, const char *msg);

/* ---------------------------------------------------------------------------------------------
 * Data types and reduction operators
 * ------------------------------------------------------------------------------------------- */
/* Memory kinds a buffer can live in. Host memory is 0, so zero-initialised options mean host
 * buffers. */
typedef enum xccl_mem_type {
    XCCL_MEM_HOST = 0,
    XCCL_MEM_CUDA = 1,
    XCCL_MEM_TYPES /* number of memory types */
} xccl_mem_type_t;

typedef enum xccl_dtype {
    XCCL_BOOL = 0,
    XCCL_UINT8,
    XCCL_INT8,
    XCCL_INT16,
    XCCL_INT32,
    XCCL_INT64,
    XCCL_FLOAT16,
    XCCL_BFLOAT16,
    XCCL_FLOAT32,
    XCCL_FLOAT64,
    XCCL_COMPLEX64,
    XCCL_COMPLEX128,
    XCCL_DTYPE_COUNT
} xccl_dtype_t;

typedef enum xccl_op {
    XCCL_OP_SUM = 0,
    XCCL_OP_PROD,
    XCCL_OP_MIN,
    XCCL_OP_MAX,
    XCCL_OP_BAND,
    XCCL_OP_BOR,
    XCCL_OP_BXOR,
    XCCL_OP_AVG,        /* sum, then divide by the group size                            */
    XCCL_OP_PREMUL_SUM, /* every input multiplied by a factor, then summed               */
    XCCL_OP_COUNT
} xccl_op_t;

size_t      xccl_dtype_size(xccl_dtype_t dtype); /* 0 for an invalid dtype */
const char *xccl_dtype_name(xccl_dtype_t dtype); /* "float32"; "?" if invalid */
const char *xccl_op_name(xccl_op_t op);          /* "sum"; "?" if invalid */
/* Name of the reduction kernel set chosen at run time: "avx512", "avx2" or "generic". */
const char *xccl_reduce_isa(void);
/* XCCL_OK if `op` is meaningful for `dtype` (bitwise ops need integers or bool, MIN/MAX need
 * an ordered type), else XCCL_ERR_INVALID_ARG with a message naming both. */
xccl_status_t xccl_op_check(xccl_op_t op, xccl_dtype_t dtype);

/* ---------------------------------------------------------------------------------------------
 * Key/value stores (rendezvous). Values are byte strings. All calls block the caller up to the
 * given timeout; timeout_ms < 0 means "the store's default timeout".
 * ------------------------------------------------------------------------------------------- */
typedef struct xccl_store xccl_store_t;

/* TCP store. With is_master, a server is started in a background thread of this process,
 * bound to `host` (NULL or "" = all addresses; port 0 = pick a free port, see
 * xccl_store_tcp_port). Every process (the master too) then connects as a client.
 * wait_for_workers: the master's create waits until world_size clients have connected.
 * auth_key (may be NULL): a shared secret; when set, the server and every client prove
 * knowledge of it by HMAC-SHA-256 challenge-response, and the key never crosses the wire. */
xccl_status_t xccl_store_tcp_create(const char *host, int port, int is_master, int world_size,
                                    int wait_for_workers, int64_t timeout_ms,
                                    const void *auth_key, size_t auth_key_len,
                                    xccl_store_t **out);
/* The port the TCP store's server listens on (or that the client connected to). -1 otherwise. */
int xccl_store_tcp_port(const xccl_store_t *store);
/* A store in a file shared by all processes (locked with fcntl). */
xccl_status_t xccl_store_file_create(const char *path, int world_size, int64_t timeout_ms,
                                     xccl_store_t **out);
/* An in-process store (threads of one process). */
xccl_status_t xccl_store_hash_create(int64_t timeout_ms, xccl_store_t **out);
/* Every key is prefixed with `prefix` + "/" before it reaches `base` (which is retained). */
xccl_status_t xccl_store_prefix_create(const char *prefix, xccl_store_t *base,
                                       xccl_store_t **out);

/* A store implemented by the caller (e.g. a Python object). Callbacks may block; they must be
 * thread-safe. Unused callbacks may be NULL (the operation then fails with NOT_SUPPORTED). */
typedef struct xccl_store_ops {
    xccl_status_t (*set)(void *ctx, const char *key, const void *val, size_t len);
    /* *val is allocated with malloc(); the store frees it with free(). */
    xccl_status_t (*get)(void *ctx, const char *key, int64_t timeout_ms, void **val, size_t *len);
    xccl_status_t (*add)(void *ctx, const char *key, int64_t delta, int64_t *result);
    xccl_status_t (*wait)(void *ctx, const char *const *keys, size_t nkeys, int64_t timeout_ms);
    xccl_status_t (*check)(void *ctx, const char *const *keys, size_t nkeys, int *all_present);
    xccl_status_t (*compare_set)(void *ctx, const char *key, const void *expected, size_t elen,
                                 const void *desired, size_t dlen, void **out, size_t *outlen);
    xccl_status_t (*delete_key)(void *ctx, const char *key, int *deleted);
    xccl_status_t (*num_keys)(void *ctx, int64_t *n);
    void (*release)(void *ctx); /* called once when the store is freed */
} xccl_store_ops_t;
xccl_status_t xccl_store_custom_create(const xccl_store_ops_t *ops, void *ctx,
                                       int64_t timeout_ms, xccl_store_t **out);

void          xccl_store_retain(xccl_store_t *store);
void          xccl_store_release(xccl_store_t *store); /* frees at refcount 0 */
void          xccl_store_set_timeout(xccl_store_t *store, int64_t timeout_ms);
int64_t       xccl_store_get_timeout(const xccl_store_t *store);
xccl_status_t xccl_store_set(xccl_store_t *s, const char *key, const void *val, size_t len);
/* Waits for `key` up to the timeout. *val is malloc'd (free with xccl_free). */
xccl_status_t xccl_store_get(xccl_store_t *s, const char *key, int64_t timeout_ms, void **val,
                             size_t *len);
/* Adds delta to the integer stored (as decimal text) under key (missing = 0). */
xccl_status_t xccl_store_add(xccl_store_t *s, const char *key, int64_t delta, int64_t *result);
/* Waits until all keys exist; XCCL_ERR_TIMEOUT names the missing ones. */
xccl_status_t xccl_store_wait(xccl_store_t *s, const char *const *keys, size_t nkeys,
                              int64_t timeout_ms);
xccl_status_t xccl_store_check(xccl_store_t *s, const char *const *keys, size_t nkeys,
                               int *all_present);
/* torch semantics: if the key is missing and `expected` is empty, or the key holds `expected`,
 * store `desired`. *out receives the value now stored (or `expected` when the key is missing
 * and expected is non-empty). *out is malloc'd. */
xccl_status_t xccl_store_compare_set(xccl_store_t *s, const char *key, const void *expected,
                                     size_t elen, const void *desired, size_t dlen, void **out,
                                     size_t *outlen);
xccl_status_t xccl_store_delete_key(xccl_store_t *s, const char *key, int *deleted);
xccl_status_t xccl_store_num_keys(xccl_store_t *s, int64_t *n);

/* ---------------------------------------------------------------------------------------------
 * Communicators
 * ------------------------------------------------------------------------------------------- */
typedef struct xccl_comm xccl_comm_t;
typedef struct xccl_work xccl_work_t;

typedef struct xccl_comm_config {
    int           rank;
    int           size;
    xccl_store_t *store;        /* used during creation only; not retained                   */
    int64_t       timeout_ms;   /* default per-operation timeout; <= 0: XCCL_TIMEOUT_MS/600 s */
    const char   *transports;   /* "shm,tcp"; NULL: $XCCL_TRANSPORTS, else every transport   */
    const void   *auth_key;     /* job secret; NULL: $XCCL_AUTH_KEY, else no authentication  */
    size_t        auth_key_len;
    const char   *name;         /* for messages; may be NULL                                 */
} xccl_comm_config_t;

/* Collective over the store: every rank 0..size-1 calls it. Connects to every peer through the
 * best transport both can use (see xccl_comm_peer_transport). Fails within timeout_ms with a
 * message naming the ranks that did not show up. */
xccl_status_t xccl_comm_create(const xccl_comm_config_t *cfg, xccl_comm_t **out);
/* A sub-communicator over `ranks` (ranks of `parent`, distinct, in the order that defines the
 * new ranks). Called by the members only; purely local (no communication, cannot deadlock).
 * Members must create sub-communicators of the same rank list in the same order. It shares
 * the parent's connections and progress engine; it stays valid after the parent is destroyed. */
xccl_status_t xccl_comm_split(xccl_comm_t *parent, int nranks, const int *ranks,
                              const char *name, xccl_comm_t **out);
/* Fails every pending operation with XCCL_ERR_ABORTED and frees the communicator. Local: never
 * waits for peers. Connections are closed when the last communicator sharing them goes. */
void xccl_comm_destroy(xccl_comm_t *comm);
/* Fails every pending operation with XCCL_ERR_ABORTED; later calls fail at once. */
void xccl_comm_abort(xccl_comm_t *comm);

int           xccl_comm_rank(const xccl_comm_t *comm);
int           xccl_comm_size(const xccl_comm_t *comm);
uint64_t      xccl_comm_id(const xccl_comm_t *comm);
/* Rank in the communicator created by xccl_comm_create that `rank` of `comm` maps to. */
int           xccl_comm_global_rank(const xccl_comm_t *comm, int rank);
/* Name of the transport used to reach `peer` ("tcp", "shm", "self"). */
const char   *xccl_comm_peer_transport(const xccl_comm_t *comm, int peer);
/* The sticky asynchronous error of the communicator (XCCL_OK if none). */
xccl_status_t xccl_comm_async_error(const xccl_comm_t *comm);
/* [ptr, ptr + nbytes) is about to be freed or remapped: the memory registrations that the
 * transports of comm's connections (shared by every communicator split from the same one)
 * cached for any part of it are dropped, each deregistered once no operation in flight uses it.
 * Call it before freeing or remapping memory that operations used, where a transport registers
 * memory (RDMA); elsewhere it does nothing. Operations still running on that memory must be
 * finished first. XCCL_ERR_INVALID_ARG: comm is NULL. */
xccl_status_t xccl_comm_mem_invalidate(xccl_comm_t *comm, const void *ptr, size_t nbytes);

/* ---------------------------------------------------------------------------------------------
 * Work: one posted operation. Created by the operations below with one reference owned by
 * the caller, which must drop it with xccl_work_release() (dropping it does not cancel the
 * operation; the library keeps its own reference until completion). Buffers passed to an
 * operation must stay valid until the Work completes.
 * ------------------------------------------------------------------------------------------- */

/* Drives progress once without blocking. XCCL_OK when complete, XCCL_INPROGRESS, or the error. */
xccl_status_t xccl_work_test(xccl_work_t *w);
/* Blocks up to `slice_ms` (< 0: until done). Returns XCCL_INPROGRESS when the slice elapsed
 * (so callers can check for signals and call again), XCCL_OK, or the operation's error. The
 * operation's own deadline (the communicator timeout) turns into XCCL_ERR_TIMEOUT. */
xccl_status_t xccl_work_wait(xccl_work_t *w, int64_t slice_ms);
/* The same with the slice in microseconds: a short wait that still polls, yields and
 * notices the end of the operation as xccl_work_wait does. */
xccl_status_t xccl_work_wait_us(xccl_work_t *w, int64_t slice_us);
xccl_status_t xccl_work_status(const xccl_work_t *w); /* no progress */
/* Device memory: makes `stream` (a CUstream; NULL: the legacy default stream) wait until the
 * Work has completed; the wait is queued on the stream and the call returns, the CPU does not
 * wait (see Streams below). XCCL_OK when queued (or when the Work already succeeded: nothing
 * to wait for), the Work's error when it has failed by then, XCCL_ERR_INVALID_USAGE for a Work
 * on host memory. */
xccl_status_t xccl_work_wait_stream(xccl_work_t *w, void *stream);
/* Message of a failed Work ("" otherwise); valid while the Work is. */
const char   *xccl_work_error(const xccl_work_t *w);
int           xccl_work_source(const xccl_work_t *w); /* sender of a completed receive */
size_t        xccl_work_nbytes(const xccl_work_t *w); /* bytes received by a receive   */
const char   *xccl_work_algo(const xccl_work_t *w);   /* algorithm used ("p2p" for p2p) */
const char   *xccl_work_name(const xccl_work_t *w);   /* "all_reduce", "send", ...       */
uint64_t      xccl_work_seq(const xccl_work_t *w);
/* CLOCK_MONOTONIC nanoseconds at enqueue, first progress (the enqueue time for an operation
 * started as it is posted) and completion (0 if not yet). */
void          xccl_work_times(const xccl_work_t *w, uint64_t *enqueue_ns, uint64_t *start_ns,
                              uint64_t *end_ns);
/* `cb` runs exactly once, when the Work completes (successfully or not), on whichever thread
 * completes it (the background progress thread or a waiter), with no xccl lock held. If the
 * Work is already complete, it runs at once on the calling thread. One callback per Work. */
typedef void  (*xccl_work_cb_t)(xccl_work_t *w, void *arg);
xccl_status_t xccl_work_on_complete(xccl_work_t *w, xccl_work_cb_t cb, void *arg);
void          xccl_work_retain(xccl_work_t *w);
void          xccl_work_release(xccl_work_t *w);

/* ---------------------------------------------------------------------------------------------
 * Operations. All are non-blocking: they validate their arguments (returning an error before
 * anything moves), post the operation and return a Work. Collectives must be called by every
 * rank of the communicator in the same order; each message carries the communicator id, the
 * operation's sequence number and a fingerprint of the call, so mismatched calls fail on the
 * ranks involved with XCCL_ERR_MISMATCH naming both calls.
 * ------------------------------------------------------------------------------------------- */
#define XCCL_ANY_SOURCE (-1)

typedef struct xccl_coll_opts {
    const char *algo;          /* force an algorithm by name; NULL: cost-model choice        */
    double      premul_factor; /* for XCCL_OP_PREMUL_SUM                                     */
    int64_t     timeout_ms;    /* <= 0: the communicator's                                   */
    int         blocking;      /* the caller waits right away: do not hand the operation to  */
                               /* the background progress thread                             */
    xccl_mem_type_t mem;       /* where the buffers live (zero: host memory); a type without */
                               /* an executor in this process fails the call (NOT_SUPPORTED) */
    void           *stream;    /* device memory: the caller's stream (a CUstream; NULL: the  */
                               /* legacy default stream). See "Streams" below.               */
} xccl_coll_opts_t;

/* Options of a point-to-point operation (NULL: host memory). */
typedef struct xccl_p2p_opts {
    xccl_mem_type_t mem;
    void           *stream; /* as in xccl_coll_opts_t */
} xccl_p2p_opts_t;

/* Streams (device memory). An operation on device memory runs after the work queued on
 * opts->stream before the call (the GPU waits for it: the call never blocks the CPU on the
 * device), on a stream of its communicator's own, with its copies and reductions done by the
 * device. The Work completes (xccl_work_test/wait report XCCL_OK) when its device work has
 * finished.
 * xccl_work_wait_stream orders a stream of the caller after the Work; a Work that fails
 * releases such waiting streams too (its error is reported by xccl_work_test/wait/status,
 * never by the device). Deadlock freedom: driver calls that may synchronise the device
 * (mapping a peer's buffer, allocating or freeing device or pinned memory) would wait for a
 * stream held by such a wait, and so for the operation itself. xccl makes them only while no
 * stream waits for an unfinished operation; otherwise it goes without: it allocates with the
 * stream-ordered allocator, sends a message through host memory, runs a one-host "devmap"
 * collective through messages for that call (every rank with it), or defers a release. No
 * operation is ever held up by such a refusal, so a stream may wait for any operation as soon
 * as it is posted. A collective that fails after a stream started waiting breaks its
 * communicator (later calls fail with its error). The same holds for other threads of the process: one that frees device memory
 * while a stream waits only waits for that operation, which completes without it. */

/* Messages between a pair with the same tag are matched in posting order. A receive buffer
 * smaller than the message fails the receive (no truncation). peer = XCCL_ANY_SOURCE receives
 * from any rank (see xccl_work_source). */
xccl_status_t xccl_isend(xccl_comm_t *comm, const void *buf, size_t nbytes, int peer,
                         uint32_t tag, xccl_work_t **w);
xccl_status_t xccl_irecv(xccl_comm_t *comm, void *buf, size_t nbytes, int peer, uint32_t tag,
                         xccl_work_t **w);
/* The same on memory of any type (opts NULL: host memory, as xccl_isend/xccl_irecv). */
xccl_status_t xccl_isend_opts(xccl_comm_t *comm, const void *buf, size_t nbytes, int peer,
                              uint32_t tag, const xccl_p2p_opts_t *opts, xccl_work_t **w);
xccl_status_t xccl_irecv_opts(xccl_comm_t *comm, void *buf, size_t nbytes, int peer,
                              uint32_t tag, const xccl_p2p_opts_t *opts, xccl_work_t **w);

/* sbuf == rbuf means in place. Counts are elements. opts may be NULL. */
xccl_status_t xccl_allreduce(xccl_comm_t *comm, const void *sbuf, void *rbuf, size_t count,
                             xccl_dtype_t dtype, xccl_op_t op, const xccl_coll_opts_t *opts,
                             xccl_work_t **w);
xccl_status_t xccl_broadcast(xccl_comm_t *comm, void *buf, size_t count, xccl_dtype_t dtype,
                             int root, const xccl_coll_opts_t *opts, xccl_work_t **w);
/* rbuf is significant at the root only (may be NULL elsewhere). */
xccl_status_t xccl_reduce(xccl_comm_t *comm, const void *sbuf, void *rbuf, size_t count,
                          xccl_dtype_t dtype, xccl_op_t op, int root,
                          const xccl_coll_opts_t *opts, xccl_work_t **w);
/* count elements from each rank; rbuf holds size * count, rank-major. */
xccl_status_t xccl_allgather(xccl_comm_t *comm, const void *sbuf, void *rbuf, size_t count,
                             xccl_dtype_t dtype, const xccl_coll_opts_t *opts, xccl_work_t **w);
xccl_status_t xccl_gather(xccl_comm_t *comm, const void *sbuf, void *rbuf, size_t count,
                          xccl_dtype_t dtype, int root, const xccl_coll_opts_t *opts,
                          xccl_work_t **w);
/* sbuf (root only) holds size * count; each rank receives count into rbuf. */
xccl_status_t xccl_scatter(xccl_comm_t *comm, const void *sbuf, void *rbuf, size_t count,
                           xccl_dtype_t dtype, int root, const xccl_coll_opts_t *opts,
                           xccl_work_t **w);
/* sbuf holds size * count; rank r receives the reduction of every rank's block r. */
xccl_status_t xccl_reduce_scatter(xccl_comm_t *comm, const void *sbuf, void *rbuf, size_t count,
                                  xccl_dtype_t dtype, xccl_op_t op,
                                  const xccl_coll_opts_t *opts, xccl_work_t **w);
/* Block j of sbuf (count elements) goes to rank j; block i of rbuf comes from rank i. */
xccl_status_t xccl_alltoall(xccl_comm_t *comm, const void *sbuf, void *rbuf, size_t count,
                            xccl_dtype_t dtype, const xccl_coll_opts_t *opts, xccl_work_t **w);
/* Uneven all-to-all: counts and displacements in elements, one per rank. */
xccl_status_t xccl_alltoallv(xccl_comm_t *comm, const void *sbuf, const size_t *scounts,
                             const size_t *sdispls, void *rbuf, const size_t *rcounts,
                             const size_t *rdispls, xccl_dtype_t dtype,
                             const xccl_coll_opts_t *opts, xccl_work_t **w);
xccl_status_t xccl_barrier(xccl_comm_t *comm, const xccl_coll_opts_t *opts, xccl_work_t **w);

/* ---------------------------------------------------------------------------------------------
 * Introspection: algorithm choice, tracing, flight recorder
 * ------------------------------------------------------------------------------------------- */
typedef struct xccl_algo_info {
    char   name[32];
    char   summary[192];
    double steps;        /* message rounds on the critical path                              */
    double bytes;        /* bytes sent by one rank on the critical path                      */
    double reduce_bytes; /* bytes combined locally                                           */
    double predicted_s;  /* alpha * steps + beta * bytes + gamma * reduce_bytes              */
    int    applicable;
    int    chosen;       /* the one xccl would run (honouring $XCCL_ALGO)                    */
    double copy_bytes;   /* bytes the rank copies through memory itself (priced with delta)  */
    /* on the chosen row, where the choice came from: "env" ($XCCL_ALGO), "table" (a tuning
     * table, $XCCL_TUNE_FILE), "rule" (a built-in rule) or "model" (the cost model); "" on
     * the others */
    char source[16];
} xccl_algo_info_t;

/* Every algorithm of collective `coll` ("all_reduce", "broadcast", ...) for `size` ranks and a
 * message of nbytes (nccl-tests size). model: {alpha s, beta s/byte, gamma s/byte} or NULL for
 * the built-in defaults. Writes up to max entries and their number to *n. */
xccl_status_t xccl_explain(const char *coll, size_t nbytes, int size, const double *model,
                           xccl_algo_info_t *out, int max, int *n);
/* The built-in default model {alpha, beta, gamma}. */
void          xccl_default_model(double model[3]);

typedef enum xccl_trace_kind {
    XCCL_TRACE_SEND   = 0,
    XCCL_TRACE_RECV   = 1,
    XCCL_TRACE_REDUCE = 2,
} xccl_trace_kind_t;

/* One primitive step of an operation, as recorded on this rank. Ranks are ranks of the
 * communicator; times are CLOCK_MONOTONIC nanoseconds. */
typedef struct xccl_trace_event {
    uint64_t seq;      /* operation number on the communicator                          */
    uint32_t step;     /* algorithm step (tag) of the message                           */
    int32_t  kind;     /* xccl_trace_kind_t                                             */
    int32_t  src, dst; /* sender and receiver (both this rank for a reduction)          */
    int32_t  buf;      /* 0 send buffer, 1 receive buffer, 2 scratch, -1 other          */
    uint64_t offset;   /* byte offset of the data in that buffer                        */
    uint64_t nbytes;
    uint64_t t_start_ns, t_end_ns;
    char     op[24];   /* "all_reduce", "send", ...                                     */
    char     algo[24];
    char     transport[8];
} xccl_trace_event_t;

/* Starts (capacity > 0 events, oldest dropped when full) or stops (0) recording. */
xccl_status_t xccl_comm_trace(xccl_comm_t *comm, size_t capacity);
/* Moves up to max recorded events into out (oldest first); returns how many. */
size_t        xccl_comm_trace_drain(xccl_comm_t *comm, xccl_trace_event_t *out, size_t max);
/* Number of events dropped because the buffer was full since tracing started. */
uint64_t      xccl_comm_trace_dropped(const xccl_comm_t *comm);

/* The α-β-γ model ({alpha s, beta s/byte, gamma s/byte}) the communicator prices one-level
 * algorithms with: its transport's between hosts when its members span several hosts
 * (*nnodes > 1), else the one inside a host. nnodes may be NULL. */
void xccl_comm_cost_model(const xccl_comm_t *comm, double model[3], int *nnodes);
/* The algorithm a call of `coll` ("all_reduce", ...) with nbytes (as in xccl_explain) would
 * run on this communicator with no algo= and $XCCL_ALGO as it is: the cost model with the
 * communicator's topology and models, and the built-in rules. Its name into name[len]. */
xccl_status_t xccl_comm_choose(const xccl_comm_t *comm, const char *coll, size_t nbytes,
                               char *name, size_t len);

/* xccl_explain for this communicator: priced as the selector prices its calls, one-level
 * algorithms with xccl_comm_cost_model's model and two-level ones with the links inside and
 * between its hosts (their steps, bytes and reduce_bytes are then the sums over both kinds of
 * link); `chosen` is what xccl_comm_choose answers. */
xccl_status_t xccl_comm_explain(const xccl_comm_t *comm, const char *coll, size_t nbytes,
                                xccl_algo_info_t *out, int max, int *n);

/* Flight recorder: a text table of the last operations of the communicator (completed ones
 * and the pending ones with what they wait for). Returns the length written (truncated to
 * len - 1, always NUL-terminated). */
size_t xccl_comm_flight_dump(xccl_comm_t *comm, char *buf, size_t len);

/* Hang diagnosis: asks every other member of the communicator where it stands (its pending
 * operations and whom they wait for, or the last one it finished) and writes one row per rank,
 * the table a timeout appends to its error. Needs nothing from the other ranks' callers: they
 * answer from their progress (a waiting thread or the progress thread). Blocks up to wait_ms
 * (less once every member answered or is known dead). Returns the length written (truncated to
 * len - 1, always NUL-terminated; 0 for a single-rank or destroyed communicator). */
size_t xccl_comm_diag_table(xccl_comm_t *comm, int64_t wait_ms, char *buf, size_t len);

/* ---------------------------------------------------------------------------------------------
 * CUDA. The library never links the CUDA driver: it loads libcuda.so.1 on first use. A process
 * uses one GPU (xccl_cuda_set_device); its device memory is then XCCL_MEM_CUDA.
 * ------------------------------------------------------------------------------------------- */
typedef struct xccl_cuda_info {
    int  built;          /* the CUDA support (executor, kernels, cuda_ipc) is in this build  */
    int  loaded;         /* the driver is loaded and initialised                              */
    int  ndevices;       /* devices the driver sees (0 when not loaded)                       */
    int  device;         /* the device this process uses (-1: none chosen yet)                */
    int  driver_version; /* cuDriverGetVersion, e.g. 13000 (0 when not loaded)                */
    int  header_version; /* CUDA_VERSION of the headers xccl was built with (0: not built)    */
    char why[256];       /* why not built or not loaded ("" when usable)                      */
    char archs[160];     /* compiled GPU code, e.g. "sm_75 sm_80 ... compute_120"             */
    char device_name[96];/* the chosen device's name ("" when none)                           */
    int  cc_major, cc_minor;
} xccl_cuda_info_t;

/* Fills *out; loads the driver if no call did yet (never fails: `why` says what is missing). */
void xccl_cuda_info(xccl_cuda_info_t *out);
/* Chooses the GPU of this process (loads the driver, retains the device's primary context -
 * the one PyTorch and CuPy use - and makes XCCL_MEM_CUDA usable). Calling it again with the
 * same device does nothing; another device is XCCL_ERR_INVALID_USAGE (one GPU per process).
 * XCCL_ERR_NOT_SUPPORTED: not built with CUDA, or no driver; XCCL_ERR_INVALID_ARG: no such
 * device. */
xccl_status_t xccl_cuda_set_device(int device);
/* Checks that [ptr, ptr + nbytes) is device memory of the chosen device within one allocation,
 * not managed (unified) memory: XCCL_OK, or XCCL_ERR_INVALID_ARG with a message saying what
 * it is instead. XCCL_ERR_INVALID_USAGE before xccl_cuda_set_device. */
xccl_status_t xccl_cuda_check_ptr(const void *ptr, size_t nbytes);

#ifdef __cplusplus
}
#endif
#endif /* XCCL_H */
