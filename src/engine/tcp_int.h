/* The TCP transport of the transfer engine, private to its three files:
 * tcp.c (blocking I/O helpers shared by both sides, start, stop and the
 * transport ops), tcp_out.c (the writer side: sessions, connections,
 * submit) and tcp_in.c (the target side: accept, hello, inbound chunks,
 * eviction). The wire format is in tcp_proto.h, the inbound framing
 * checks in tcp_frame.c. */
#ifndef KVF_ENGINE_TCP_INT_H
#define KVF_ENGINE_TCP_INT_H

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "base/addr.h"
#include "base/clock.h"
#include "base/log.h"
#include "base/wake.h"
#include "engine/engine_internal.h"
#include "engine/evpool.h"
#include "engine/tcp_frame.h"
#include "engine/tcp_proto.h"

#define TCP_IOV_BATCH 512
#define TCP_INLINE_MAX_BYTES (1u << 20)
/* An inbound connection reads framing and small payloads through a stage
 * of this size (one recv per chunk instead of one per part); larger reads
 * go straight into their destination. */
#define TCP_IN_STAGE_BYTES (64u << 10)
/* Acknowledgements read (writer) or sent (target) per system call at most. */
#define TCP_ACK_BATCH 64
#define TCP_MAX_SESSIONS 4096
/* Every blocking receive ends within a tick, so overall deadlines (a batch's,
 * a hello's, an inbound chunk's) and unregisters are noticed in time. */
#define TCP_READER_TICK_MS 100
/* An outgoing connection's sender and acknowledgement reader end after this
 * long with nothing to do, and start again with the next chunk: an idle
 * peer holds no thread (issue 24). */
#define TCP_CONN_IDLE_MS 2000
/* Attempts to evict a connection that keeps changing state under us. */
#define TCP_EVICT_TRIES 8
/* When every inbound slot is taken, a connection still in its hello for
 * less than this is evicted only after the idle ones that never sent a
 * chunk: a writer's fresh connection (its hello in flight, or not yet read
 * on a loaded target) is not what a flood of silent connections displaces. */
#define TCP_HELLO_GRACE_MS 200

typedef struct tcp_state tcp_state;

/* Walks the pieces of a block list (strided blocks expand to count pieces)
 * and fills iovec batches, so any number of pieces costs O(1) memory. */
typedef struct piece_iter {
  size_t i;       /* block index */
  uint64_t piece; /* piece within the block */
} piece_iter;

typedef struct piece_src {
  /* Either writer-side blocks (src addresses) or target-side descriptors. */
  const kvf_write *writes;
  const tcp_desc *descs;
  size_t n;
} piece_src;

typedef struct tcp_conn {
  atomic_int refs;
  int fd;
  atomic_int dead; /* 0, or the error that killed it */
  char peer[KVF_ADDR_LEN];
  int timeout_ms;
  pthread_mutex_t send_lock; /* serialises bytes on the socket */
  pthread_mutex_t q_lock;    /* guards the two lists below */
  pthread_cond_t q_cv;
  chunk *q_head, *q_tail; /* waiting to be sent */
  chunk *f_head, *f_tail; /* sent, waiting for their ack, in wire order */
  /* The deadline of the chunk whose bytes are being sent (0: none): the
   * reader watches it too, as an ack may come before the payload has gone
   * (a broken or hostile target), which takes the chunk off f_head while
   * the sender may still block in sendmsg (q_lock). */
  int64_t sending_deadline_ns;
  uint64_t next_seq;
  /* The threads run only while there is work (TCP_CONN_IDLE_MS): *_on says
   * one runs (q_lock), *_joinable that `writer`/`reader` holds a thread
   * not joined yet (the one that starts the next, or the last put, joins
   * it; q_lock). */
  pthread_t writer, reader;
  int writer_on, reader_on, writer_joinable, reader_joinable;
} tcp_conn;

typedef struct tcp_session {
  pthread_mutex_t lock;
  char id[KVF_ADDR_LEN];
  char host[KVF_ADDR_HOST_LEN];
  uint16_t port;
  tcp_conn *conns[16];
  unsigned rr;
  atomic_int connecting; /* a submit holds `lock` while it connects (kvf__engine_submit_lock) */
} tcp_session;

struct tcp_state {
  kvf_engine *e;
  int listen_fd;
  pthread_t accept_thread;
  atomic_int stopping;
  pthread_mutex_t in_lock;
  struct tcp_inbound *inbound; /* guarded by in_lock, as are the two counts */
  int n_inbound;
  int n_evicted;   /* evicted, not yet reaped */
  evpool *in_pool; /* the inbound connections while idle (tcp_in.c) */
  pthread_mutex_t sess_lock;
  smap sessions;
};

/* tcp.c */
void kvf__tcp_set_timeout(int fd, int opt, int ms);
int kvf__tcp_send_all(int fd, const void *buf, size_t len);
int kvf__tcp_recv_msg_or_idle(int fd, void *buf, size_t len, size_t cap, size_t *got, int tick_ms, int rest_ms);
void kvf__tcp_iov_advance(struct iovec **iov, int *cnt, size_t n);
int kvf__tcp_iter_fill(const piece_src *s, piece_iter *it, struct iovec *iov, int max);
int kvf__tcp_xfer_pieces(int fd, const piece_src *s, int sending, const struct iovec *head, int nhead,
                         const struct iovec *tail, int ntail);

/* tcp_out.c */
void kvf__tcp_conn_put(tcp_conn *c);
int kvf__tcp_submit(kvf_engine *e, const char *session, chunk **chunks, size_t nchunks);

/* tcp_in.c */
/* Free the finished inbound connections (all: every one, once the pool
 * is stopped). */
void kvf__tcp_inbound_reap(tcp_state *t, int all);
/* Shut every inbound connection's socket down (stop). */
void kvf__tcp_inbound_cut_all(tcp_state *t);
extern const evpool_ops kvf__tcp_inbound_ops;
/* Inbound workers kept while idle, and how long others stay idle. */
#define TCP_IN_CORE_WORKERS 2
#define TCP_IN_RETIRE_MS 2000
void *kvf__tcp_accept_main(void *arg);
int kvf__tcp_listen_on(kvf_engine *e, int *fd_out, uint16_t *port_out);

#endif
