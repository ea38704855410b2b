/* Room traces: the manager's ring of finished rooms, the /metrics
 * histograms fed from it, the KVFERRY_TRACE JSON lines and their parser
 * (see kv/trace.h for how a room is recorded, docs/TRACE.md for the schema
 * and what each step is on each path). The ring's mutex is a leaf: held
 * only to copy one record in or out. */
#include "kv/trace.h"

#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/log.h"
#include "base/thread.h"
#include "base/parse.h"
#include "engine/async.h"
#include "kv/manager.h"

static const char *const step_names[KVF_TRACE_NSTEPS] = {
    "created",
    "discovery_done",
    "m1_sent",
    "m2_sent",
    "first_byte",
    "last_byte",
    "completion_seen",
    "m2_received",
    "sender_created",
    "first_chunk_submitted",
    "last_chunk_submitted",
    "first_byte_sent",
    "last_byte_done",
    "completion_sent",
    "final",
};

static const char *const status_names[] = {"Failed",          "Bootstrapping", "Bootstrapped",
                                           "WaitingForInput", "Transferring",  "Success"};

/* ---- histograms ---- */

/* Bucket bounds chosen for this workload: a room's transfer takes from
 * tens of microseconds (one page over loopback) to tens of seconds (a long
 * prompt over a slow link or a stuck peer); a request moves from one 4 KiB
 * page to many GiB; one request's bandwidth runs from a congested TCP link
 * to NVLink-class copies. */
static const double lat_bounds[] = {50e-6,  100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
                                    100e-3, 250e-3, 500e-3, 1,      2.5,  5,      10,   30,    120};
static const double byte_bounds[] = {4096,     16384,    65536,     262144,     1048576,      4194304,
                                     16777216, 67108864, 268435456, 1073741824, 4294967296.0, 17179869184.0};
static const double bw_bounds[] = {1e7, 3e7, 1e8, 3e8, 1e9, 2e9, 4e9, 8e9, 16e9, 32e9, 64e9, 128e9};
#define HIST_MAX_BOUNDS 19

typedef struct hist {
  atomic_ullong bucket[HIST_MAX_BOUNDS + 1]; /* the last one: +Inf only */
  atomic_ullong sum;                         /* in units of 1/scale */
} hist;

typedef struct hist_def {
  const char *name, *help;
  const double *bounds;
  size_t nbounds;
  double scale; /* sum is stored as value * scale */
  int prefill_only;
} hist_def;

enum { H_M2_SUCCESS, H_QUEUE, H_BYTES, H_BW, H_N };
static const hist_def hist_defs[H_N] = {
    {"kvferry_room_m2_to_success_seconds",
     "Decode: its first M2 sent to Success seen; prefill: the first M2 received to the completion sent.",
     lat_bounds, sizeof lat_bounds / sizeof *lat_bounds, 1e9, 0},
    {"kvferry_room_queue_wait_seconds",
     "Prefill: from the room's first chunk and its M2s being there to its first engine write.", lat_bounds,
     sizeof lat_bounds / sizeof *lat_bounds, 1e9, 1},
    {"kvferry_room_bytes",
     "Bytes of a successful request: prefill written, decode landed as this engine saw them.", byte_bounds,
     sizeof byte_bounds / sizeof *byte_bounds, 1, 0},
    {"kvferry_room_bandwidth_bytes_per_second",
     "Per request: bytes / (last byte landed - first byte sent), prefill: engine submit to engine confirm; "
     "decode: first chunk landing to last chunk landed.",
     bw_bounds, sizeof bw_bounds / sizeof *bw_bounds, 1, 0},
};

struct trace_ring {
  pthread_mutex_t mu;
  kvf_room_trace *slots;
  size_t cap;
  uint64_t n; /* records ever stored; the newest is slots[(n - 1) % cap] */
  atomic_int enabled;
  hist h[H_N];
  /* KVFERRY_TRACE: the writer thread appends the ring's records from
   * `written` on, off every room's path (trace_writer_main). */
  int fd; /* -1: none */
  pthread_t writer;
  pthread_cond_t cv; /* the writer waits here: a backlog, or stop */
  int stop;
  uint64_t written;             /* records handed to the file (or dropped) */
  uint64_t dropped;             /* overwritten in the ring before the writer took them */
  _Atomic(kvf_engine *) engine; /* kvf__trace_ring_engine */
};

/* Records the writer takes per write(): at most this many lines at once,
 * each in TRACE_LINE_MAX bytes (a record with every text field escaped at
 * its longest fits). */
#define TRACE_WRITE_BATCH 16
#define TRACE_LINE_MAX 16384
/* The writer looks for finished records at least this often. */
#define TRACE_WRITE_TICK_MS 50

static void hist_observe(hist *h, const hist_def *d, double v) {
  size_t i = 0;
  while (i < d->nbounds && v > d->bounds[i]) i++;
  atomic_fetch_add_explicit(&h->bucket[i], 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&h->sum, (unsigned long long)(v * d->scale + 0.5), memory_order_relaxed);
}

/* A prefill's destination whose route the engine had not chosen yet when
 * its write was submitted (the first room to a peer: the connector picks
 * the route while the write waits) has an empty transport and mode in the
 * room's live record; they are filled here, from the engine's route to that
 * session, as the finished record leaves the ring (the file's writer, the
 * trace getters), with no lock of the library held: the engine's peer
 * locks must not nest inside the prefill's or the callbacks' (a room's
 * record is finished under the prefill's lock). */
static void trace_routes_fill(kvf_engine *e, kvf_room_trace *t) {
  if (!e || t->side != KVF_ROLE_PREFILL) return;
  for (uint32_t i = 0; i < t->npeers && i < KVF_TRACE_MAX_PEERS; i++) {
    kvf_trace_peer *p = &t->peers[i];
    const char *transport = "", *mode = "";
    if (p->transport[0] || kvf__engine_peer_path(e, p->peer, &transport, &mode)) continue;
    kvf__str_copy(p->transport, sizeof p->transport, transport);
    kvf__str_copy(p->mode, sizeof p->mode, mode);
  }
}

/* KVFERRY_TRACE's thread: copies the records finished since the last
 * turn out of the ring (its lock held only for the copy), formats them and
 * appends them with one write() per batch of whole lines. A room's own
 * path only stores its record; a writer that falls a whole ring behind
 * loses the oldest records, counted and logged once. */
static void *trace_writer_main(void *arg) {
  kvf__thread_name("kvf-trace");
  trace_ring *r = arg;
  kvf_room_trace *batch = malloc(TRACE_WRITE_BATCH * sizeof *batch);
  char *buf = malloc((size_t)TRACE_WRITE_BATCH * TRACE_LINE_MAX);
  int warned = 0;
  pthread_mutex_lock(&r->mu);
  while (batch && buf) {
    if (r->written == r->n) {
      if (r->stop) break;
      struct timespec ts = clock_ts_from_ns(clock_deadline_ms(TRACE_WRITE_TICK_MS));
      pthread_cond_timedwait(&r->cv, &r->mu, &ts);
      continue;
    }
    if (r->n - r->written > r->cap) {
      r->dropped += r->n - r->written - r->cap;
      r->written = r->n - r->cap;
      if (!warned++)
        LOG_WARN("kv", "KVFERRY_TRACE: the file fell a whole ring behind; the oldest records are lost");
    }
    size_t k = 0;
    for (; k < TRACE_WRITE_BATCH && r->written < r->n; k++, r->written++) batch[k] = r->slots[r->written % r->cap];
    pthread_mutex_unlock(&r->mu);
    size_t len = 0;
    kvf_engine *e = atomic_load(&r->engine);
    for (size_t i = 0; i < k; i++) {
      trace_routes_fill(e, &batch[i]);
      len += kvf_trace_format_json(&batch[i], buf + len, TRACE_LINE_MAX);
    }
    if (len && write(r->fd, buf, len) != (ssize_t)len)
      LOG_WARN("kv", "KVFERRY_TRACE: trace lines could not be written whole");
    pthread_mutex_lock(&r->mu);
  }
  pthread_mutex_unlock(&r->mu);
  free(batch);
  free(buf);
  return NULL;
}

int kvf__trace_ring_new(size_t cap, trace_ring **out) {
  trace_ring *r = calloc(1, sizeof *r);
  if (!r) return KVF_ENOMEM;
  r->fd = -1;
  if (cap && !(r->slots = calloc(cap, sizeof *r->slots))) {
    free(r);
    return KVF_ENOMEM;
  }
  r->cap = cap;
  atomic_init(&r->enabled, cap > 0);
  pthread_mutex_init(&r->mu, NULL);
  const char *file = getenv("KVFERRY_TRACE");
  clock_cond_init(&r->cv);
  if (cap && file && *file) {
    r->fd = open(file, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (r->fd < 0) LOG_WARN("kv", "KVFERRY_TRACE=%s: cannot open it for appending; no trace lines", file);
    if (r->fd >= 0 && pthread_create(&r->writer, NULL, trace_writer_main, r)) {
      LOG_WARN("kv", "KVFERRY_TRACE=%s: no thread to write it; no trace lines", file);
      close(r->fd);
      r->fd = -1;
    }
  }
  *out = r;
  return 0;
}

void kvf__trace_ring_engine(trace_ring *r, kvf_engine *e) {
  if (r) atomic_store(&r->engine, e);
}

void kvf__trace_ring_stop(trace_ring *r) {
  if (!r || r->fd < 0) return;
  /* the writer appends what is left, then ends */
  pthread_mutex_lock(&r->mu);
  r->stop = 1;
  pthread_cond_signal(&r->cv);
  pthread_mutex_unlock(&r->mu);
  pthread_join(r->writer, NULL);
  close(r->fd);
  r->fd = -1;
}

void kvf__trace_ring_free(trace_ring *r) {
  if (!r) return;
  kvf__trace_ring_stop(r);
  pthread_cond_destroy(&r->cv);
  pthread_mutex_destroy(&r->mu);
  free(r->slots);
  free(r);
}

int kvf_manager_trace_enable(kvf_manager *m, int on) {
  if (!m) return KVF_EINVAL;
  if (!m->trace->cap) return KVF_ESTATE;
  atomic_store(&m->trace->enabled, on != 0);
  return 0;
}

void kvf__trace_begin(kvf_manager *m, trace_live *tl) {
  int on = atomic_load_explicit(&m->trace->enabled, memory_order_relaxed);
  for (int i = 0; i < KVF_TRACE_NSTEPS; i++) atomic_store_explicit(&tl->t[i], 0, memory_order_relaxed);
  for (int i = 0; i < TRACE_NCOUNTERS; i++) atomic_store_explicit(&tl->n[i], 0, memory_order_relaxed);
  tl->npeers = 0;
  tl->t0_unix_ns = 0;
  if (on) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    tl->t0_unix_ns = (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
  }
  atomic_store(&tl->on, on);
}

void kvf__trace_snapshot(kvf_manager *m, const trace_live *tl, int64_t room, kvf_room_trace *out) {
  memset(out, 0, sizeof *out);
  out->room = room;
  out->side = m->cfg.role;
  out->rank = m->tp_rank;
  kvf__str_copy(out->engine, sizeof out->engine, kvf_manager_session_id(m));
  for (int i = 0; i < KVF_TRACE_NSTEPS; i++) out->t_ns[i] = atomic_load(&tl->t[i]);
  out->bytes = atomic_load(&tl->n[TRACE_BYTES]);
  out->descs = atomic_load(&tl->n[TRACE_DESCS]);
  out->chunks = atomic_load(&tl->n[TRACE_CHUNKS]);
  out->retries = atomic_load(&tl->n[TRACE_RETRIES]);
  out->t0_unix_ns = tl->t0_unix_ns;
  out->npeers = tl->npeers;
  memcpy(out->peers, tl->peers, sizeof out->peers);
}

static int64_t span(const kvf_room_trace *t, int a, int b) {
  return t->t_ns[a] && t->t_ns[b] && t->t_ns[b] >= t->t_ns[a] ? t->t_ns[b] - t->t_ns[a] : -1;
}

static void observe(trace_ring *r, const kvf_room_trace *t) {
  if (t->status != KVF_POLL_SUCCESS) return;
  int pf = t->side == KVF_ROLE_PREFILL;
  int64_t d = pf ? span(t, KVF_TRACE_M2_RECEIVED,
                        t->t_ns[KVF_TRACE_COMPLETION_SENT] ? KVF_TRACE_COMPLETION_SENT : KVF_TRACE_LAST_BYTE_DONE)
                 : span(t, KVF_TRACE_M2_SENT, KVF_TRACE_COMPLETION_SEEN);
  if (d >= 0) hist_observe(&r->h[H_M2_SUCCESS], &hist_defs[H_M2_SUCCESS], d / 1e9);
  if (pf) {
    /* the wait starts when both the first chunk and the M2 are there */
    int from = t->t_ns[KVF_TRACE_M2_RECEIVED] > t->t_ns[KVF_TRACE_FIRST_CHUNK_SUBMITTED]
                   ? KVF_TRACE_M2_RECEIVED
                   : KVF_TRACE_FIRST_CHUNK_SUBMITTED;
    if ((d = span(t, from, KVF_TRACE_FIRST_BYTE_SENT)) >= 0)
      hist_observe(&r->h[H_QUEUE], &hist_defs[H_QUEUE], d / 1e9);
  }
  if (t->bytes) {
    hist_observe(&r->h[H_BYTES], &hist_defs[H_BYTES], (double)t->bytes);
    d = pf ? span(t, KVF_TRACE_FIRST_BYTE_SENT, KVF_TRACE_LAST_BYTE_DONE)
           : span(t, KVF_TRACE_FIRST_BYTE, KVF_TRACE_LAST_BYTE);
    if (d > 0) hist_observe(&r->h[H_BW], &hist_defs[H_BW], (double)t->bytes * 1e9 / (double)d);
  }
}

void kvf__trace_finish(kvf_manager *m, trace_live *tl, int64_t room, int status, const char *reason) {
  trace_ring *r = m->trace;
  if (!atomic_exchange(&tl->on, 0) || !r->cap) return;
  kvf_room_trace t;
  kvf__trace_snapshot(m, tl, room, &t);
  t.status = status;
  t.finished = 1;
  kvf__str_copy(t.reason, sizeof t.reason, reason ? reason : "");
  pthread_mutex_lock(&r->mu);
  r->slots[r->n % r->cap] = t;
  r->n++;
  /* The file's writer wakes by itself every tick; told only when half the
   * ring waits, so a room pays no syscall for it. */
  if (r->fd >= 0 && r->n - r->written == r->cap / 2 + 1) pthread_cond_signal(&r->cv);
  pthread_mutex_unlock(&r->mu);
  observe(r, &t);
}

typedef struct live_get {
  kvf_manager *m;
  int64_t room;
  kvf_room_trace *out;
} live_get;

static int copy_live(void *user, void *arg) {
  live_get *g = arg;
  const trace_live *tl = user ? g->m->role->trace_of(user) : NULL;
  if (!tl || !kvf__trace_on(tl)) return 0;
  kvf__trace_snapshot(g->m, tl, g->room, g->out);
  return 1;
}

int kvf_manager_trace_get(kvf_manager *m, int64_t room, kvf_room_trace *out) {
  if (!m || !out) return KVF_EINVAL;
  trace_ring *r = m->trace;
  kvf_room_trace t;
  live_get g = {m, room, &t};
  if (r->cap && kvf__rooms_with_user(m->rooms, room, copy_live, &g) == 1) {
    int st = ROOM_FAILED;
    kvf__rooms_get_status(m->rooms, room, &st);
    t.status = st;
    kvf__rooms_get_reason(m->rooms, room, t.reason, sizeof t.reason);
    trace_routes_fill(m->engine, &t);
    *out = t;
    return 0;
  }
  int rc = KVF_ENOTFOUND;
  pthread_mutex_lock(&r->mu);
  size_t kept = r->n < r->cap ? (size_t)r->n : r->cap;
  for (size_t i = 0; i < kept && rc; i++) {
    const kvf_room_trace *s = &r->slots[(r->n - 1 - i) % r->cap];
    if (s->room == room) *out = *s, rc = 0;
  }
  pthread_mutex_unlock(&r->mu);
  if (!rc) trace_routes_fill(m->engine, out);
  return rc;
}

size_t kvf_manager_trace_copy(kvf_manager *m, kvf_room_trace *out, size_t cap) {
  if (!m || !out || !cap) return 0;
  trace_ring *r = m->trace;
  pthread_mutex_lock(&r->mu);
  size_t kept = r->n < r->cap ? (size_t)r->n : r->cap, k = kept < cap ? kept : cap;
  for (size_t i = 0; i < k; i++) out[i] = r->slots[(r->n - k + i) % r->cap];
  pthread_mutex_unlock(&r->mu);
  for (size_t i = 0; i < k; i++) trace_routes_fill(m->engine, &out[i]);
  return k;
}

const char *kvf_trace_step_name(int step) {
  return step >= 0 && step < KVF_TRACE_NSTEPS ? step_names[step] : NULL;
}

/* ---- JSON ---- */

typedef struct out_buf {
  char *p;
  size_t n, cap;
  int full;
} out_buf;

__attribute__((format(printf, 2, 3))) static void put(out_buf *b, const char *fmt, ...) {
  if (b->full) return;
  va_list ap;
  va_start(ap, fmt);
  int w = vsnprintf(b->p + b->n, b->cap - b->n, fmt, ap);
  va_end(ap);
  if (w < 0 || (size_t)w >= b->cap - b->n) b->full = 1;
  else b->n += (size_t)w;
}

static void put_str(out_buf *b, const char *s) {
  put(b, "\"");
  while (*s && !b->full) {
    size_t run = 0; /* plain characters go in one piece */
    while (s[run] && s[run] != '"' && s[run] != '\\' && (unsigned char)s[run] >= 0x20 && s[run] != 0x7f) run++;
    if (run) put(b, "%.*s", (int)run, s), s += run;
    else if (*s == '"' || *s == '\\') put(b, "\\%c", *s++);
    else put(b, "\\u%04x", (unsigned char)*s++);
  }
  put(b, "\"");
}

size_t kvf_trace_format_json(const kvf_room_trace *t, char *buf, size_t cap) {
  if (!t || !buf || !cap) return 0;
  out_buf b = {buf, 0, cap, 0};
  int order[KVF_TRACE_NSTEPS], n = 0;
  for (int i = 0; i < KVF_TRACE_NSTEPS; i++) /* reached steps, by time (stable: the enum's order on ties) */
    if (t->t_ns[i]) {
      int k = n++;
      while (k > 0 && t->t_ns[order[k - 1]] > t->t_ns[i]) order[k] = order[k - 1], k--;
      order[k] = i;
    }
  int64_t first = n ? t->t_ns[order[0]] : 0;
  int st = t->status >= 0 && t->status <= KVF_POLL_SUCCESS ? t->status : 0;
  put(&b, "{\"v\":1,\"side\":\"%s\",\"room\":%" PRIu64 ",\"engine\":",
      t->side == KVF_ROLE_PREFILL ? "prefill" : "decode", (uint64_t)t->room);
  put_str(&b, t->engine);
  put(&b, ",\"rank\":%d,\"status\":\"%s\",\"reason\":", t->rank, status_names[st]);
  if (t->reason[0]) put_str(&b, t->reason);
  else put(&b, "null");
  put(&b, ",\"t0_unix_ns\":%" PRId64 ",\"steps\":[", t->t0_unix_ns);
  for (int k = 0; k < n; k++)
    put(&b, "%s{\"name\":\"%s\",\"t_ns\":%" PRId64 "}", k ? "," : "", step_names[order[k]],
        t->t_ns[order[k]] - first);
  put(&b,
      "],\"bytes\":%" PRIu64 ",\"descs\":%" PRIu64 ",\"chunks\":%" PRIu64 ",\"retries\":%" PRIu64 ",\"peers\":[",
      t->bytes, t->descs, t->chunks, t->retries);
  for (uint32_t i = 0; i < t->npeers && i < KVF_TRACE_MAX_PEERS; i++) {
    put(&b, "%s{\"peer\":", i ? "," : "");
    put_str(&b, t->peers[i].peer);
    put(&b, ",\"transport\":");
    put_str(&b, t->peers[i].transport);
    put(&b, ",\"mode\":");
    put_str(&b, t->peers[i].mode);
    put(&b, "}");
  }
  put(&b, "]}\n");
  if (b.full) {
    buf[0] = '\0';
    return 0;
  }
  return b.n;
}

static void copy_str(char *dst, size_t cap, json_t *v) {
  const char *s = json_is_string(v) ? json_string_value(v) : "";
  kvf__str_copy(dst, cap, s);
}

int kvf_trace_parse_json(const char *line, kvf_room_trace *out) {
  if (!line || !out) return KVF_EINVAL;
  json_error_t err;
  json_t *j = json_loads(line, JSON_REJECT_DUPLICATES, &err);
  kvf_room_trace t;
  memset(&t, 0, sizeof t);
  int rc = KVF_EINVAL;
  json_t *steps = j ? json_object_get(j, "steps") : NULL;
  if (!json_is_object(j) || json_integer_value(json_object_get(j, "v")) != 1 || !json_is_array(steps)) goto out;
  const char *side = json_string_value(json_object_get(j, "side"));
  if (!side || (strcmp(side, "decode") && strcmp(side, "prefill"))) goto out;
  t.side = strcmp(side, "prefill") ? KVF_ROLE_DECODE : KVF_ROLE_PREFILL;
  t.room = (int64_t)json_integer_value(json_object_get(j, "room"));
  t.rank = (int)json_integer_value(json_object_get(j, "rank"));
  t.finished = 1;
  const char *st = json_string_value(json_object_get(j, "status"));
  for (int i = 0; st && i <= KVF_POLL_SUCCESS; i++)
    if (!strcmp(st, status_names[i])) t.status = i;
  copy_str(t.engine, sizeof t.engine, json_object_get(j, "engine"));
  copy_str(t.reason, sizeof t.reason, json_object_get(j, "reason"));
  t.t0_unix_ns = (int64_t)json_integer_value(json_object_get(j, "t0_unix_ns"));
  t.bytes = (uint64_t)json_integer_value(json_object_get(j, "bytes"));
  t.descs = (uint64_t)json_integer_value(json_object_get(j, "descs"));
  t.chunks = (uint64_t)json_integer_value(json_object_get(j, "chunks"));
  t.retries = (uint64_t)json_integer_value(json_object_get(j, "retries"));
  size_t i;
  json_t *v;
  /* Offsets from the first step; 1 ns added so the first step reads as reached. */
  json_array_foreach(steps, i, v) {
    const char *name = json_string_value(json_object_get(v, "name"));
    for (int s = 0; name && s < KVF_TRACE_NSTEPS; s++)
      if (!strcmp(name, step_names[s])) t.t_ns[s] = (int64_t)json_integer_value(json_object_get(v, "t_ns")) + 1;
  }
  json_t *peers = json_object_get(j, "peers");
  json_array_foreach(peers, i, v) {
    if (t.npeers >= KVF_TRACE_MAX_PEERS) break;
    kvf_trace_peer *p = &t.peers[t.npeers++];
    copy_str(p->peer, sizeof p->peer, json_object_get(v, "peer"));
    copy_str(p->transport, sizeof p->transport, json_object_get(v, "transport"));
    copy_str(p->mode, sizeof p->mode, json_object_get(v, "mode"));
  }
  *out = t;
  rc = 0;
out:
  json_decref(j);
  return rc;
}

/* ---- /metrics ---- */

size_t kvf__trace_metrics(kvf_manager *m, char *buf, size_t n, size_t cap) {
  trace_ring *r = m->trace;
  if (!r->cap) return n;
  const char *role = m->role->name, *session = kvf_manager_session_id(m);
  int pf = m->cfg.role == KVF_ROLE_PREFILL;
  for (int k = 0; k < H_N; k++) {
    const hist_def *d = &hist_defs[k];
    const hist *h = &r->h[k];
    if (d->prefill_only && !pf) continue;
    out_buf b = {buf + n, 0, cap - n, 0};
    put(&b, "# TYPE %s histogram\n", d->name);
    unsigned long long cum = 0;
    for (size_t i = 0; i <= d->nbounds; i++) {
      cum += atomic_load_explicit(&h->bucket[i], memory_order_relaxed);
      if (i < d->nbounds)
        put(&b, "%s_bucket{role=\"%s\",session=\"%s\",le=\"%.9g\"} %llu\n", d->name, role, session, d->bounds[i],
            cum);
      else put(&b, "%s_bucket{role=\"%s\",session=\"%s\",le=\"+Inf\"} %llu\n", d->name, role, session, cum);
    }
    put(&b, "%s_sum{role=\"%s\",session=\"%s\"} %.9g\n", d->name, role, session,
        (double)atomic_load(&h->sum) / d->scale);
    put(&b, "%s_count{role=\"%s\",session=\"%s\"} %llu\n", d->name, role, session, cum);
    if (b.full) { /* whole histograms only */
      buf[n] = '\0';
      break;
    }
    n += b.n;
  }
  return n;
}
