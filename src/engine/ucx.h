/* Internal shape of the UCX transport (ucx.c: context, worker, progress,
 * registration, pools and the rendezvous server; ucx_peer.c: the writer
 * side, per-peer routing and puts).
 *
 * Rendezvous: a peer connects to the engine's TCP listener and sends a
 * tcp_hello with TCP_UCX_HELLO_MAGIC and its token (checked exactly as for
 * a data connection). After the accepting reply, the server sends one info
 * message, then another whenever its registrations change (generation + 1)
 * and whenever the client sends a ucx_req. The connection stays open: its
 * closing tells the writer that the peer is gone.
 *
 *   info  ucx_info_hdr, then body_len bytes: the worker address (addr_len),
 *         then per region a ucx_region_desc followed by rkey_len bytes.
 *   ack   the writer applied a pushed info (ucx_req); unregister returns once
 *         every connected writer acknowledged the generation without the
 *         region, or after UCX_CTL_TIMEOUT_MS, when the laggard's rendezvous
 *         connection is cut (which ends its endpoint to this engine).
 *
 * Thread mode: the worker is created UCS_THREAD_MODE_SERIALIZED and every
 * UCP call on it is made under ucx_state.wmu. The progress thread holds wmu
 * only while it progresses and arms; it sleeps in epoll on the worker's
 * event fd, a wake eventfd and the peers' rendezvous sockets. Lock order:
 * ucx_peer.rw, then ucx_state.wmu; callbacks run under wmu and take only a
 * batch mutex (kvf__chunk_finish). */
#ifndef KVF_ENGINE_UCX_H
#define KVF_ENGINE_UCX_H

#include <ucp/api/ucp.h>

#include "engine/engine_internal.h"
#include "engine/evpool.h"

#define UCX_INFO_MAGIC 0x4b564649u
#define UCX_REQ_MAGIC 0x4b564652u
#define UCX_ACK_MAGIC 0x4b56464bu
#define UCX_FENCE_MAGIC 0x4b564643u     /* target -> writer: a fence closed (ucx_fence_msg) */
#define UCX_FENCE_ACK_MAGIC 0x4b564661u /* writer -> target: ucx_req, gen = the fence message's seq */
/* writer -> target: ucx_req with reserved = the length, then that many
 * bytes: a batch's completion trailer (async.h), sent only once the
 * chunk's puts were flushed (its bytes are in place). */
#define UCX_TRAILER_MAGIC 0x4b564654u
/* target -> writer: ucx_req, a trailer was handled (in order). */
#define UCX_TRAILER_ACK_MAGIC 0x4b564674u
/* Read mode (ucx_read.c), writer -> target: a ready notice (ucx_notice),
 * ndesc kvf_write descriptors (sources in the writer's memory, destinations
 * in the target's) and tlen trailer bytes; the target checks it, reads the
 * bytes itself and answers UCX_READ_DONE_MAGIC. */
#define UCX_NOTICE_MAGIC 0x4b56464eu
/* target -> writer: ucx_req, reserved = the status (0 or a negative KVF_E*
 * code as uint32_t), gen = the notice's id. */
#define UCX_READ_DONE_MAGIC 0x4b564664u
/* target -> writer: ucx_req, gen = the target's clock (ns); the writer
 * answers UCX_CLOCK_ANS_MAGIC (ucx_clock_ans) at once. */
#define UCX_CLOCK_MAGIC 0x4b56464cu
#define UCX_CLOCK_ANS_MAGIC 0x4b56466cu
/* The rendezvous protocol version a UCX hello carries (tcp_hello.version). */
#define UCX_PROTO_VERSION 2
/* Bounds of a ready notice, checked by the target before it reads one. */
#define UCX_MAX_NOTICE_DESC 16384u
#define UCX_MAX_LEASE_MS ENGINE_MAX_LEASE_MS
/* A target re-measures its bound on the writer's clock this often (ns), and
 * allows the clocks to drift apart by this much per second meanwhile (ns):
 * 500 ppm, the most NTP slews a clock. */
#define UCX_CLOCK_PING_NS 1000000000ll
#define UCX_CLOCK_DRIFT_PPM 500
/* Reads into the target's memory are copied or posted in slices of this
 * size, the fence and revocations checked between them. */
#define UCX_READ_SLICE (256u * 1024u)
/* Gets (CMA, the network) land in a bounce buffer of the connection first
 * and are copied into place slice by slice, the fence checked between
 * slices: a get that a cancel could not stop (UCX's tcp places data after a
 * forced endpoint close) lands in a buffer nobody reads, which is then
 * quarantined until the engine stops. Loads from a mapped pool go straight
 * into place. */
#define UCX_BOUNCE_BYTES (2u << 20)
#define UCX_BOUNCE_PIECES 4096u /* gets in flight into one bounce buffer at most */
/* Closed fences a writer remembers per peer beyond its last snapshot; past
 * this it asks for a new info (whose snapshot makes them redundant). */
#define UCX_MAX_CLOSED_FENCES 65536u
#define UCX_MAX_OPEN_FENCES (1u << 20) /* ENGINE_MAX_FENCES (fence.c) */
#define UCX_HOST_ID_LEN 128
#define UCX_MAX_ADDR_LEN (64u * 1024u)
#define UCX_MAX_REGIONS 4096u
#define UCX_MAX_RKEY_LEN (64u * 1024u)
#define UCX_RKEY_PARSE_PAD (64u * 1024u) /* zeroed bytes behind a received info body (ucx_peer.c) */
#define UCX_MAX_INFO_BODY (16u << 20)
/* A reader maps at most this much of one writer's pools ahead, after
 * connect (ucx_warm.c): each mapped GiB costs the reader ~2 MiB of page
 * tables and ~0.1-0.5 s of one thread here, per writer; what lies past it
 * faults in on its first read. Same-host writers only (a host holds a few
 * ranks, not hundreds). */
#define UCX_POPULATE_MAX (1ull << 30)
/* ...a slice at a time: a stop (the writer's keys released) waits at most
 * for one slice (about 0.1 ms here). */
#define UCX_WARM_SLICE (256u * 1024u)
/* A rendezvous message must arrive whole within this once it has started. */
#define UCX_CTL_TIMEOUT_MS 5000
/* A send to one writer while the rendezvous list's lock (ctl_mu) is held
 * (an info to a new or every connection, a fence close) must go within
 * this, or that writer is cut: a socket that full belongs to a writer that
 * does not read it, and every other writer's control waits on the lock. */
#define UCX_CTL_LOCKED_SEND_MS 1000
#define UCX_REFRESH_ROUNDS 3 /* region refreshes before a write outside them is refused (ucx_write.c) */
/* The progress thread's tick while batches are in flight (deadline checks). */
#define UCX_TICK_MS 50
#define UCX_IDLE_TICK_MS 2000 /* ... and while none is, at least this often (the first op wakes it) */
#define UCX_MAX_COPIERS 15
/* Rendezvous connections this engine serves at most (its own bound: they do
 * not take the TCP transport's max_inbound_conns slots once authenticated). */
#define UCX_MAX_RENDEZVOUS 4096
/* Rendezvous workers kept while idle; more are started while connections
 * have messages to handle, and retire after UCX_CTL_RETIRE_MS idle. */
#define UCX_CTL_CORE_WORKERS 2
#define UCX_CTL_RETIRE_MS 2000

/* ucx_info_hdr.flags */
#define UCX_INFO_READ 0x1u   /* target -> writer: this connection runs in read mode */
#define UCX_INFO_WRITER 0x2u /* writer -> target: the writer's own memory, for reads */
#define UCX_INFO_CMA 0x4u    /* writer -> target: the body ends with a ucx_cma_probe */

/* Reads of a writer's private memory on one host with process_vm_readv
 * (ucx_read.c, docs/WIRE-EXTENSIONS.md "Reads"): the writer's pid, and a
 * value at an address of its own memory that the target reads back first,
 * so a pid from another PID namespace, or a process the target may not
 * read, is never read from. At the end of a writer info's body. */
#define UCX_CMA_MAGIC 0x4b56434du
typedef struct ucx_cma_probe {
  uint32_t magic;
  uint32_t pid;
  uint64_t addr;  /* of `value` in the writer's memory */
  uint64_t value; /* random, per engine */
} ucx_cma_probe;

typedef struct ucx_info_hdr {
  uint32_t magic;
  uint32_t nregions;
  uint64_t gen;
  uint32_t addr_len;
  uint32_t body_len;
  char host_id[UCX_HOST_ID_LEN]; /* boot id, host name, IPC and network namespaces */
  uint32_t flags;
  uint32_t reserved;
  int64_t clock_ns; /* the sender's CLOCK_MONOTONIC when it built the message */
  int64_t echo_ns;  /* UCX_INFO_WRITER: clock_ns of the target's info it answers */
} ucx_info_hdr;

/* A ready notice (read mode): the writer's chunk `id` may be read. lease_ns
 * from sent_ns (the writer's clock): the writer keeps the sources as they
 * are until then at least (docs/WIRE-EXTENSIONS.md, "Decode-initiated
 * reads"). */
typedef struct ucx_notice {
  uint32_t magic;
  uint32_t ndesc;
  uint64_t id;
  uint64_t tag, epoch;
  int64_t sent_ns;
  int64_t lease_ns;
  uint32_t tlen;
  uint32_t reserved;
} ucx_notice;

typedef struct ucx_clock_ans {
  uint32_t magic;
  uint32_t reserved;
  int64_t echo_ns;  /* the target's clock from its UCX_CLOCK_MAGIC */
  int64_t clock_ns; /* the writer's clock when it answered */
} ucx_clock_ans;

typedef struct ucx_region_desc {
  uint64_t base;
  uint64_t len;
  uint32_t rkey_len;
  uint32_t reserved;
} ucx_region_desc;

/* Writer → target: UCX_REQ_MAGIC asks for an info message; UCX_ACK_MAGIC
 * says the info of generation `gen` is applied (no new write uses an older
 * one), which unregister waits for. */
typedef struct ucx_req {
  uint32_t magic;
  uint32_t reserved;
  uint64_t gen;
} ucx_req;

/* After the regions, an info body carries the target's fence snapshot
 * (kvf__fence_snapshot): ucx_fence_snap, then nopen epochs (uint64_t). A
 * tagged write whose epoch is below `next` and not among them, or that a
 * later ucx_fence_msg closed, is refused by the writer (KVF_ESTATE). */
typedef struct ucx_fence_snap {
  uint64_t next;
  uint32_t nopen;
  uint32_t reserved;
} ucx_fence_snap;

/* Target -> writer: (tag, epoch) is closed. The writer stops writing for it
 * (no new block starts), flushes what it has in flight to this target and
 * answers UCX_FENCE_ACK_MAGIC with gen = seq; seqs rise, and an ack covers
 * every lower seq (its flush came after theirs). */
typedef struct ucx_fence_msg {
  uint32_t magic;
  uint32_t reserved;
  uint64_t tag, epoch, seq;
} ucx_fence_msg;

_Static_assert(sizeof(ucx_info_hdr) == 176, "info header layout");
_Static_assert(sizeof(ucx_notice) == 56, "notice layout");
_Static_assert(sizeof(ucx_clock_ans) == 24, "clock answer layout");
_Static_assert(sizeof(ucx_fence_snap) == 16, "fence snapshot layout");
_Static_assert(sizeof(ucx_fence_msg) == 32, "fence message layout");
_Static_assert(sizeof(ucx_region_desc) == 24, "region descriptor layout");

/* A region this engine registered with UCX. */
typedef struct ucx_reg {
  uint64_t base, len;
  ucp_mem_h memh;
  void *rkey_buf;
  size_t rkey_len;
  int pool; /* allocated by ucp_mem_map (kvf_engine_alloc_pool) */
  int host; /* readable host memory here; 0: device memory (counted in ucx_state.device_regs) */
} ucx_reg;

/* A region a peer advertised. ptr: where it is mapped here (ucp_rkey_ptr),
 * or NULL when it is reached with puts. */
typedef struct ucx_rregion {
  uint64_t base, len;
  ucp_rkey_h rkey;
  char *ptr;
} ucx_rregion;

typedef enum { ROUTE_UNKNOWN = 0, ROUTE_UCX, ROUTE_TCP } ucx_route;

/* Read-ahead on a rendezvous connection: one recv takes whatever has
 * arrived, and messages are taken from it (b[off..len) received, not yet
 * taken; `b`, of `cap` bytes, is held only while bytes wait in it or the
 * connection is busy). */
typedef struct ucx_rbuf {
  unsigned char *b;
  size_t off, len, cap;
} ucx_rbuf;

/* The writer's read-ahead on its rendezvous connection: the target's
 * answers (read done, acks: 16 bytes each) that arrived together are taken
 * with one recv instead of three each (issue 22). */
#define UCX_PEER_RBUF 1024u

typedef struct ucx_peer {
  struct ucx_state *u;
  char id[KVF_ADDR_LEN];
  char host[KVF_ADDR_HOST_LEN];
  uint16_t port;
  pthread_mutex_t conn_mu; /* one (re)connection at a time */
  atomic_int connecting;   /* a submit holds conn_mu while it connects (kvf__engine_submit_lock) */
  pthread_rwlock_t rw;     /* ep, regs: read to write into the peer, write to change */
  ucp_ep_h ep;
  int fd;             /* rendezvous connection, -1 when none */
  ucx_rbuf rb;        /* on fd, the progress thread's (reset with fd, under rw for writing) */
  atomic_int rb_held; /* bytes wait in rb: a message there is not read yet (kvf__ucx_ctl_pending) */
  /* Progress thread (p->rw held): when the first byte of a message that is
   * not whole yet arrived (0: none). The rest is waited for without
   * blocking; past UCX_CTL_TIMEOUT_MS the connection is dropped
   * (kvf__ucx_partials_check), so a target that stops mid-message holds
   * no thread and delays no other peer. */
  int64_t partial_ns;
  ucx_rregion *regs;
  size_t nregs;
  uint64_t gen;
  atomic_int dead;    /* 0, or the error that ended the endpoint */
  pthread_mutex_t mu; /* infos and why below */
  /* Held by a writer from putting its trailer op on `tacks` until the
   * trailer is sent: the list order is the wire order, which is the order
   * of the target's trailer acks (kvf__ucx_trailer_acked takes the head).
   * Taken before wmu and mu, never under them. */
  pthread_mutex_t tmu;
  pthread_cond_t cv;
  uint64_t infos; /* info messages applied (refresh waits on it); cv also
                   * tells a writer waiting in do_chunk that a message was read */
  int same_host;
  int mapped; /* some region is mapped here (under mu) */
  ucx_route route;
  char why[160];
  /* The target's fences (under rw: read to check, write to change): an
   * epoch below fence_next is open only if in fence_open; fence_closed holds
   * the ones closed since the snapshot. */
  uint64_t fence_next;
  map fence_open, fence_closed;
  int fence_asked;                   /* a new snapshot was asked for (fence_closed is full) */
  atomic_int fence_wait;             /* a fence message waits for rw: tagged writers let go at their next block */
  struct ucx_op *tacks, *tacks_tail; /* trailers sent, acks due in this order (under the state's wmu) */
  atomic_int gated;                  /* writers in fence_gate with puts posted and not flushed yet */
  /* Read mode (ucx_read.c): the target reads this engine's chunks. Set with
   * the endpoint (under rw); conn_id counts rendezvous connections, and
   * info_sent_gen is this engine's registration generation the target last
   * got (under mu, as every send on fd). */
  int read_mode;
  uint64_t conn_id;
  uint64_t info_sent_gen;
  int64_t target_clock_ns; /* clock_ns of the target's last info, echoed in ours */
  uint64_t next_read_id;   /* under wmu */
  /* Under wmu: the last connection the target closed
   * (kvf__ucx_reads_closed_locked); a notice linked on it afterwards ends
   * at once instead of at its lease. */
  uint64_t reads_closed_conn;
} ucx_peer;

/* A chunk whose puts wait for an endpoint flush. Under wmu. */
typedef struct ucx_op {
  struct ucx_op *next, *prev;
  chunk *c;
  ucx_peer *p;
  struct ucx_state *u;
  int fenced;           /* its batch's fence closed meanwhile: it ends KVF_ESTATE */
  int trailer;          /* its chunk's trailer goes out once the flush is done (u->tq) */
  int err;              /* the chunk already failed (a flush still covers the puts it posted) */
  struct ucx_op *tnext; /* on its peer's FIFO of trailers sent, not yet acked */
  int gone;             /* the connection its trailer went on was dropped: the reaper fails it with this */
  /* Read mode: a notice sent, waiting for the target's read done (or the
   * lease's end, or the target closing the connection). */
  int read;
  uint64_t id, conn_id;
  int64_t lease_end_ns;
} ucx_op;

typedef struct ucx_job {
  struct ucx_job *next;
  chunk *c;
  ucx_peer *p;
  /* Or, when set, run fn(arg) (read mode: a share of a notice's copy). */
  void (*fn)(void *arg);
  void *arg;
} ucx_job;

/* A writer connected to this engine's rendezvous (ucx.c serves it). An
 * idle connection costs no thread: it waits in an evpool (evpool.h), and
 * once bytes arrive one of the pool's workers takes it, handles the
 * messages that arrived (each whole within UCX_CTL_TIMEOUT_MS) and parks it
 * again. The worker that holds it is its "serving thread". In read mode this engine reads the writer's chunks
 * itself: the fields from read_mode down belong to the serving thread
 * (ucx_read.c), except `closing`. */
#define UCX_CTL_RBUF (64u * 1024u)
/* At most this many read-done answers go out in one send (ucx_ctl.held),
 * held only while the next notice reads at most UCX_DONE_HOLD_BYTES (so an
 * answer waits for a few small copies, never for a layer's). */
#define UCX_DONE_BATCH 32u
#define UCX_DONE_HOLD_BYTES (256u * 1024u)

typedef struct ucx_ctl {
  struct ucx_ctl *next;
  evpool_item item; /* its socket (fd below) in the rendezvous pool */
  int fd;
  pthread_mutex_t send_mu;
  uint64_t acked;       /* generation the writer has applied (under ctl_mu) */
  uint64_t fence_acked; /* highest fence seq the writer confirmed (under ctl_mu) */
  /* The highest generation and fence seq sent to it (set before the send):
   * a confirmation is taken up to these only, so a writer cannot confirm
   * ahead and skip the waits of later unregisters and closes. */
  _Atomic uint64_t sent_gen, sent_fence;
  char peer[KVF_ADDR_LEN];
  int read_mode;
  /* Set before this engine shuts the connection down: a read under way then
   * does not count (the writer may take the shutdown for "reads over"). */
  atomic_int closing;
  int64_t info_ns;      /* clock_ns of the first info sent to the writer */
  ucp_ep_h ep;          /* to the writer, under wmu; NULL until its info, or after a cancel */
  atomic_int ep_failed; /* UCX reported the endpoint failed */
  void *waddr;          /* the writer's worker address (its info), to make ep again */
  size_t waddr_len;
  int same_host;
  int cma_pid;        /* the writer's pid where its probe read back (process_vm_readv works); 0 otherwise */
  ucx_rregion *wregs; /* the writer's regions (sorted), their rkeys on ep */
  size_t nwregs;
  struct ucx_warm_job *warm; /* mapping wregs ahead (ucx_warm.c), under the state's warm_mu */
  int have_skew;             /* skew_ns bounds (writer's clock - this clock) from above */
  int64_t skew_ns, skew_at_ns, ping_ns;
  unsigned char *buf; /* a notice's descriptors and trailer */
  size_t cap;
  region **pins; /* the destination regions of a notice, pinned while read */
  size_t pins_cap;
  unsigned char *bounce;     /* UCX_BOUNCE_BYTES, allocated at the first get */
  struct bounce_slice *pend; /* UCX_BOUNCE_PIECES: where the bounce buffer's slices go */
  void **reqs;               /* UCX_BOUNCE_PIECES: the gets in progress into it */
  unsigned nreq;
  struct ucx_load *loads; /* a notice's slices from a mapped pool, copied after the checks */
  size_t loads_cap;
  /* The serving thread's read-ahead (UCX_CTL_RBUF bytes, read mode, held
   * only while bytes wait in it). */
  ucx_rbuf rb;
  /* Read-done answers held back while the next notice already waits whole
   * in the read-ahead (kvf__ucx_ctl_done), sent with one call before the
   * serving thread could wait on anything (kvf__ucx_ctl_flush). */
  ucx_req held[UCX_DONE_BATCH];
  unsigned nheld;
} ucx_ctl;

typedef struct ucx_state {
  kvf_engine *e;
  ucp_context_h ctx;
  ucp_worker_h w;
  pthread_mutex_t wmu;
  void *addr;
  size_t addr_len;
  char host_id[UCX_HOST_ID_LEN];
  uint64_t *cma_value; /* this engine's probe value (ucx_cma_probe), read by same-host targets */
  int cma_off;         /* KVFERRY_UCX_CMA=0: neither offer nor use direct reads */
  int rdma;            /* this host has an RDMA device (/sys/class/infiniband) */
  int epfd, wake_fd;
  pthread_t progress;
  atomic_int stopping;
  ucx_op *ops; /* in flight, under wmu */
  ucx_op *
      orphans; /* failed by the reaper, their flush still pending (freed by its callback or at teardown), under wmu */
  ucx_op *tq;      /* flushed, their trailer to send (kvf__ucx_trailers_send), under wmu */
  atomic_int reap; /* a peer was marked dead: the progress thread ends its endpoint */
  /* registrations, under reg_mu */
  pthread_mutex_t reg_mu;
  ucx_reg *regs;
  size_t nregs, cap;
  uint64_t gen;
  /* Registrations that are not readable host memory (device memory). While
   * there are any, this engine neither reads nor is read (read mode copies
   * with the reader's CPU, which cannot touch device memory): it connects
   * and serves writers in write mode, where UCX moves device memory. */
  atomic_int device_regs;
  /* This UCX knows CUDA memory (ucp_context_query: UCS_MEMORY_TYPE_CUDA).
   * Without it, device memory is neither advertised to writers nor written
   * from: UCX would reach it only with the CPU (ucx_reg_hook). */
  int cuda_memory;
  /* The primary CUDA context of the device the first registered device
   * memory is on (ucx_cuda.c), or NULL; cuda_dev is that device. */
  _Atomic(void *) cuda_ctx;
  int cuda_dev;
  atomic_int npartial; /* peers with a partial_ns set */
  /* Under wmu: the latest time the progress thread wakes by itself, set
   * before each of its waits (kvf__ucx_op_link wakes it only for an op due
   * sooner). */
  int64_t wake_by_ns;
  /* rendezvous connections this engine serves, under ctl_mu */
  pthread_mutex_t ctl_mu;
  pthread_cond_t ctl_cv; /* an ack arrived or a connection ended */
  ucx_ctl *ctls;
  int nctls;          /* on ctls (at most UCX_MAX_RENDEZVOUS) */
  uint64_t fence_seq; /* fence messages sent (under ctl_mu) */
  evpool *ctl_pool;   /* serves the connections on ctls (evpool.h) */
  int ctl_stopping;   /* under ctl_mu: no connection is added any more */
  /* peers, by session id */
  pthread_mutex_t peers_mu;
  smap peers;
  /* copier threads for large batches into mapped pools */
  pthread_mutex_t q_mu;
  pthread_cond_t q_cv;
  ucx_job *q_head, *q_tail;
  pthread_t copiers[UCX_MAX_COPIERS];
  int ncopiers;
  /* Bounce buffers of cancelled reads (ucx_read.c): UCX may still place
   * data there, so they are freed only after the worker is gone. Under wmu. */
  void **quarantine;
  size_t nquarantine, cap_quarantine;
  /* Mapping same-host writers' pools ahead (ucx_warm.c, which states the
   * lock rules): jobs queued and the one under way, under warm_mu. */
  pthread_mutex_t warm_mu;
  pthread_cond_t warm_cv; /* the thread left a job */
  struct ucx_warm_job *warm_q, *warm_cur;
  pthread_t warm_thread;
  int warm_running;  /* the thread is on the queue (it clears this last, as it ends) */
  int warm_joinable; /* warm_thread was started and not joined yet */
} ucx_state;

/* ucx_warm.c: map the same-host writer's pools of a connection ahead of
 * its first reads (with wmu held, once its regions are in c->wregs:
 * reader_ep_make_locked); stop
 * that before the regions are released (returns once no load of them is
 * under way); at the engine's end, once every connection stopped. */
void kvf__ucx_warm_init(ucx_state *u);
void kvf__ucx_warm_start(ucx_state *u, ucx_ctl *c);
void kvf__ucx_warm_stop(ucx_state *u, ucx_ctl *c);
void kvf__ucx_warm_fini(ucx_state *u);

/* ucx.c */
int kvf__ucx_status(ucs_status_t st);
/* ucx_peer.c, progress thread: drop the connections whose message stayed
 * partial past UCX_CTL_TIMEOUT_MS (ucx_peer.partial_ns). */
void kvf__ucx_partials_check(ucx_state *u);
/* ucx_peer.c: mark every peer that reads from this engine (read mode) dead,
 * so it connects again (ucx_state.device_regs); how many. */
int kvf__ucx_peers_drop_reading(ucx_state *u);
/* ucx_peer.c: does UCX_TLS (unset: yes) let UCX use shared memory or CMA? */
int kvf__ucx_tls_allow_shm(void);
/* This engine's info message (regions, worker address, fences) for a
 * connection: `flags` (UCX_INFO_*), `echo_ns` as in ucx_info_hdr; with
 * UCX_INFO_READ the regions are left out (a reading target takes no
 * writes). Caller frees *out. */
int kvf__ucx_build_info(ucx_state *u, uint32_t flags, int64_t echo_ns, char **out, size_t *out_len);
void kvf__ucx_wake(ucx_state *u);

/* CUDA contexts for UCX's CUDA transports (ucx_cuda.c). adopt: the CUDA
 * device of registered device memory (-1: not memory the CUDA driver knows,
 * or no driver), whose primary context the engine's threads then take
 * (the first device's); enter: make it current in a thread that has none;
 * release it when the engine stops. */
int kvf__ucx_cuda_adopt(ucx_state *u, const void *addr, size_t len);
void kvf__ucx_cuda_enter(ucx_state *u);
void kvf__ucx_cuda_release(ucx_state *u);

/* Take the UCX worker (wmu), which every call into UCX holds; with device
 * memory registered, the thread gets a CUDA context first. */
static inline void kvf__ucx_wlock(ucx_state *u) {
  pthread_mutex_lock(&u->wmu);
  if (atomic_load_explicit(&u->cuda_ctx, memory_order_relaxed)) kvf__ucx_cuda_enter(u);
}

/* Receive exactly `len` bytes from fd through the read-ahead r (its buffer
 * allocated, or NULL: straight from fd) before the deadline. */
int kvf__ucx_rbuf_recv(int fd, ucx_rbuf *r, void *buf, size_t len, int64_t deadline_ns);
/* One recv into r without waiting (r->b allocated, nothing waiting in it):
 * 1 bytes wait now, 0 none arrived yet, KVF_ECLOSED the peer closed (or
 * reset) the connection, KVF_EIO it failed otherwise. */
int kvf__ucx_rbuf_fill(int fd, ucx_rbuf *r);
/* Allocate r's buffer of `cap` bytes if it has none; free it if nothing waits in it. */
int kvf__ucx_rbuf_hold(ucx_rbuf *r, size_t cap);
void kvf__ucx_rbuf_release_empty(ucx_rbuf *r);
static inline int kvf__ucx_rbuf_waiting(const ucx_rbuf *r) { return r->len > r->off; }
/* The serving thread of c: receive exactly `len` bytes through its
 * read-ahead before the deadline. */
int kvf__ucx_ctl_recv(ucx_ctl *c, void *buf, size_t len, int64_t deadline_ns);
/* The serving thread of c: answer a notice (read done). The answer is held
 * (sent at once when UCX_DONE_BATCH are held); the serving loop (ucx.c,
 * ctl_turn) sends what is held before it reads anything but a small notice
 * that already waits whole in the read-ahead (serving that waits on nothing
 * the writer has still to send, and soon ends), and before it leaves. */
int kvf__ucx_ctl_done(ucx_ctl *c, int status, uint64_t id);
/* Send the answers held back, if any (the serving thread, before anything
 * that may wait). */
int kvf__ucx_ctl_flush(ucx_ctl *c);
/* Test seam (tests/engine/test_ucx.c; NULL in every shipped program): set,
 * and returning n > 0 for this engine, a reading target sends only the
 * first n bytes of its next read-done answer, as a target that stops
 * mid-message would. */
typedef size_t (*kvf__ucx_done_cut_fn)(const kvf_engine *e);
extern _Atomic(kvf__ucx_done_cut_fn) kvf__ucx_done_cut;

/* ucx_peer.c: peers, the rendezvous client, routing */
/* Read the rest of an info message whose magic was read, bounded in size
 * and time, from fd through the read-ahead rb (NULL: none); *body (malloc'd,
 * a zeroed pad behind it) is the caller's. */
int kvf__ucx_info_read_rest(int fd, ucx_rbuf *rb, int64_t deadline_ns, ucx_info_hdr *h, char **body);
/* With wmu held: an endpoint to the worker at `address`, with UCX's
 * peer-failure handling where the transports allow it. */
int kvf__ucx_ep_create(ucx_state *u, const void *address, int same_host, ucp_err_handler_cb_t cb, void *arg,
                       const char *who, ucp_ep_h *out);
/* With wmu held: unpack the regions of an info body (from `*off`, which
 * moves past them) with keys on `ep`, mapped here where `same_host` allows;
 * sorted by base. Regions whose key does not unpack are left out. */
int kvf__ucx_regions_unpack(ucp_ep_h ep, const ucx_info_hdr *h, const char *body, size_t *off, int same_host,
                            const char *who, ucx_rregion **out, size_t *nout);
void kvf__ucx_rregions_free(ucx_rregion *regs, size_t n);
/* The region of regs (sorted) holding [addr, addr+len), or NULL. */
const ucx_rregion *kvf__ucx_rregion_find(const ucx_rregion *regs, size_t n, uint64_t addr, uint64_t len);
int kvf__ucx_describe(kvf_engine *e, const char *session, char *out, size_t cap);
int kvf__ucx_path(kvf_engine *e, const char *session, const char **transport, const char **mode);
int kvf__ucx_routes(kvf_engine *e, char *out, size_t cap);
/* Progress thread: a peer's rendezvous socket is readable or closed. */
void kvf__ucx_peer_event(ucx_state *u, ucx_peer *p, uint32_t events);
void kvf__ucx_peers_free(ucx_state *u);
/* The peer named `id`, created on first use; lives until the engine stops. */
int kvf__ucx_peer_get(ucx_state *u, const char *id, ucx_peer **out);
/* Make sure the peer has a route and, over UCX, a live endpoint (rendezvous
 * and endpoint made within the deadline). */
int kvf__ucx_peer_ensure(ucx_state *u, ucx_peer *p, int64_t deadline_ns, ucx_route *route_out);
/* Ask the peer for its current regions and wait until they are applied. */
void kvf__ucx_peer_refresh(ucx_state *u, ucx_peer *p, int64_t deadline_ns);
void kvf__ucx_peer_mark_dead(ucx_state *u, ucx_peer *p, int err);
/* With wmu (and p->rw for writing) held. */
void kvf__ucx_regs_free_locked(ucx_peer *p);
void kvf__ucx_ep_close_locked(ucx_state *u, ucx_peer *p);
/* p->rw held: is a write tagged with `epoch` refused (its fence closed)? */
int kvf__ucx_fence_refused(const ucx_peer *p, uint64_t epoch);
/* p->rw held: has the target sent something not read yet (or closed the
 * connection), or is a fence close read and waiting to be applied? */
int kvf__ucx_ctl_pending(const ucx_peer *p);

/* ucx_write.c */
int kvf__ucx_submit(kvf_engine *e, const char *session, chunk **chunks, size_t nchunks);
/* Progress thread: end the endpoints of peers marked dead, and fail flushes
 * past their deadline. */
void kvf__ucx_reap(ucx_state *u);
/* Progress thread only, with wmu held and p->ep set: flush the endpoint
 * and progress until done (wmu is let go between idle progress calls), the
 * peer dies or until_ns. */
int kvf__ucx_flush_wait_locked(ucx_state *u, ucx_peer *p, int64_t until_ns);
/* With wmu held: flushes in flight to `p` for `epoch` end KVF_ESTATE; how
 * many there are (0: every put for it is complete). */
int kvf__ucx_ops_fence_locked(ucx_state *u, ucx_peer *p, uint64_t epoch);
/* Frees every op left (teardown, after the worker is gone; no lock needed then). */
void kvf__ucx_ops_free(ucx_state *u);
/* With wmu held: the chunks whose trailers went on p's rendezvous
 * connection and wait for its acknowledgement are to fail with `err` (the
 * connection is being dropped: no ack will come); the reaper finishes them
 * on its next round, outside the peer's locks. */
void kvf__ucx_tacks_fail_locked(ucx_peer *p, int err);
void kvf__ucx_copier_start(ucx_state *u);
/* Queue a job for the copier threads (0, or KVF_ENOMEM / KVF_EBUSY when
 * there are none: the caller does the work itself). */
int kvf__ucx_copier_queue(ucx_state *u, ucx_job *j);
/* Take a queued job back: 1 when no copier had taken it yet (it never runs),
 * 0 when one has (it runs or ran: its owner waits for it as it would). */
int kvf__ucx_copier_unqueue(ucx_state *u, ucx_job *j);
/* Progress thread, no lock held: send the trailers of flushed chunks (tq)
 * and finish those chunks. */
void kvf__ucx_trailers_send(ucx_state *u);
/* Progress thread: the target handled the oldest trailer sent to it. */
void kvf__ucx_trailer_acked(ucx_state *u, ucx_peer *p);
void kvf__ucx_op_link(ucx_op *op);
void kvf__ucx_op_unlink(ucx_op *op);

/* ucx_read.c: read mode */
/* Writer, p->rw held for reading: send the chunk as a ready notice; it
 * finishes at the target's read done, the lease's end or the target
 * closing the connection. */
void kvf__ucx_notice_send(ucx_state *u, ucx_peer *p, chunk *c);
/* Writer, progress thread: the target answered notice `id` sent on
 * connection `conn_id`. */
void kvf__ucx_read_done(ucx_state *u, ucx_peer *p, uint64_t conn_id, uint64_t id, int status);
/* Writer, p->rw held: resend this engine's info to the target when its
 * registrations changed since the last one sent (read mode). */
int kvf__ucx_writer_info_refresh(ucx_state *u, ucx_peer *p);
/* Writer: the target closed connection `conn_id` (it reads nothing more
 * for it; this side closing it is not enough: a live target still reads
 * what is in its socket, so those notices keep their lease). Its notices,
 * and any linked on it later, fail at the reaper's next round, which this
 * wakes. The _locked form with wmu held (and wakes nobody). */
void kvf__ucx_reads_closed(ucx_state *u, ucx_peer *p, uint64_t conn_id);
void kvf__ucx_reads_closed_locked(ucx_peer *p, uint64_t conn_id);
/* Target, serving thread of `c`: the writer's info (UCX_INFO_WRITER), a
 * notice, a clock answer, each after its magic was read. 0 to go on, an
 * error to drop the connection. */
int kvf__ucx_serve_writer_info(ucx_state *u, ucx_ctl *c);
int kvf__ucx_serve_notice(ucx_state *u, ucx_ctl *c);
int kvf__ucx_serve_clock(ucx_state *u, ucx_ctl *c);
/* Target: free what the serving thread of `c` kept for reading. */
void kvf__ucx_ctl_reader_free(ucx_state *u, ucx_ctl *c);

#endif
