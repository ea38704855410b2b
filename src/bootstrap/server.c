/* The bootstrap HTTP rendezvous server (PROTOCOL §4) on libmicrohttpd. One
 * internal epoll thread serves every connection: each request is a table
 * lookup or a small JSON parse, so a thread pool would only add hand-offs,
 * and MHD's event loop keeps a slow client from blocking the others.
 * Connections cannot run out (issue 13, defect 2): MHD's timeout is an idle
 * timeout that a byte now and then resets, so the server tracks every
 * connection itself — each request must be complete within a deadline from
 * the connection's start or the previous reply (a guard thread shuts down the
 * ones that are not), and when the slots are nearly all taken a new
 * connection evicts the oldest one still waiting for its request headers, or
 * else the oldest request still in progress. The
 * routing table is sized once, from the first registration's world size
 * (bounded by the PUT parser), and never grows afterwards; a mutex guards it
 * because the public API promises nothing about which thread MHD calls us on.
 * Every rejected request is counted by kind for GET /metrics and logged once
 * per peer and kind. */
#include <arpa/inet.h>
#include <microhttpd.h>
#include <netdb.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>

#include "base/addr.h"
#include "base/config.h"
#include "base/clock.h"
#include "base/hash.h"
#include "base/log.h"
#include "base/parse.h"
#include "base/thread.h"
#include "bootstrap/bootstrap.h"
#include "bootstrap/metrics_text.h"
#include "kvferry/bootstrap.h"
#include "kvferry/engine.h"
#include "wire/route_json.h"

#define COMP "bootstrap"
#define DEFAULT_PORT 8998
#define DEFAULT_MAX_BODY (64u * 1024)
#define DEFAULT_MAX_CONNS 1024
#define DEFAULT_IDLE_S 30
/* A request (headers and body) must be complete this soon after the
 * connection opened or its previous reply; idle_timeout_s lowers it. */
#define REQUEST_DEADLINE_S 10
/* The guard thread wakes this long after the earliest connection deadline. */
#define GUARD_SLACK_MS 1
/* A connection this young that has not sent its headers yet is a client
 * about to: it is evicted only when no request has been running longer. */
#define EVICT_GRACE_MS 2000
/* Connections kept free for newcomers: at this many free slots or fewer (an
 * eighth of max_conns at most), a new connection evicts the oldest one still
 * waiting for its headers (or, if none, the oldest request in progress). */
#define MIN_FREE_SLOTS 8

/* Rejection kinds, the label values of kvferry_bootstrap_errors_total. */
enum {
  ERR_BAD_REQUEST,
  ERR_NOT_FOUND,
  ERR_METHOD,
  ERR_TOO_LARGE,
  ERR_UNAUTHORIZED,
  ERR_CONFLICT,
  ERR_SLOW,    /* connection shut down at the request deadline */
  ERR_EVICTED, /* connection closed to make room for a new one */
  ERR_NKINDS
};
static const char *const err_names[ERR_NKINDS] = {"bad_request",  "not_found", "method", "too_large",
                                                  "unauthorized", "conflict",  "slow",   "evicted"};

/* One open connection, from MHD's STARTED to its CLOSED notification. */
typedef struct conn_track {
  struct conn_track *prev, *next;
  int fd;
  int in_request;   /* headers are in: being answered */
  int cut;          /* already shut down by us */
  int served;       /* answered a request already: idle now means keep-alive */
  int64_t since_ns; /* connection start or previous reply: the request deadline runs from here */
} conn_track;

typedef struct rank_entry {
  int set;
  int port;
  char ip[KVF_ADDR_HOST_LEN];
} rank_entry;

struct kvf_bootstrap_server {
  struct MHD_Daemon *mhd;
  uint16_t port;
  char *token; /* NULL = PUT is open */
  size_t max_body;

  pthread_mutex_t lock;
  /* Guarded by lock. Sizes are -1 until the first PUT, then frozen. */
  int64_t world_size, dp_size, tp;
  rank_entry *table; /* [dp_group * tp + tp_rank], world_size entries */
  int64_t ranks_set;
  int enable_mla_l1_5_cache;
  route_lens lists[ROUTE_NLISTS]; /* owned; present = sent at least once */

  kvf_engine *engines[KVF_BOOTSTRAP_MAX_ENGINES]; /* /metrics route lines, under lock */
  int nengines;
  kvf_metrics_fn sources[KVF_BOOTSTRAP_MAX_SOURCES]; /* kvf_bootstrap_server_add_metrics, under lock */
  void *source_args[KVF_BOOTSTRAP_MAX_SOURCES];
  int nsources;
  atomic_uint_fast64_t registrations, lookups, parallel_infos, health_checks;
  atomic_uint_fast64_t errors[ERR_NKINDS];

  /* Connection tracking (see the top of the file). */
  pthread_mutex_t conns_lock;
  pthread_cond_t guard_cv;
  int guard_sleeping;                     /* the guard waits for a connection to track (conns_lock) */
  conn_track conns;                       /* list head; scans are O(open connections), at most max_conns */
  unsigned nconns, max_conns, free_slots; /* free_slots: see MIN_FREE_SLOTS */
  int64_t deadline_ns;
  int stopping;
  pthread_t guard;
};

/* Per-request state, from the first handler call to MHD's completion
 * notification. */
typedef struct request {
  int endpoint;
  char *body;
  size_t len;
  int replied; /* a response was queued before the body was read */
} request;

enum { EP_ROUTE, EP_HEALTH, EP_METRICS, EP_UNKNOWN };

void kvf_bootstrap_server_config_init(kvf_bootstrap_server_config *cfg) {
  if (!cfg) return;
  memset(cfg, 0, sizeof *cfg);
  cfg->size = sizeof *cfg;
  cfg->host = "0.0.0.0";
  cfg->port = DEFAULT_PORT;
  cfg->max_body = DEFAULT_MAX_BODY;
  cfg->max_conns = DEFAULT_MAX_CONNS;
  cfg->idle_timeout_s = DEFAULT_IDLE_S;
}

static void peer_name(struct MHD_Connection *conn, char *out, size_t outlen) {
  const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
  kvf__addr_from_sockaddr(out, outlen, ci ? ci->client_addr : NULL);
}

static enum MHD_Result send_reply(struct MHD_Connection *conn, unsigned status, const char *ctype,
                                  const char *body, size_t len, const char *hname, const char *hval) {
  struct MHD_Response *resp = MHD_create_response_from_buffer(len, (void *)body, MHD_RESPMEM_MUST_COPY);
  if (!resp) return MHD_NO;
  MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
  if (hname) MHD_add_response_header(resp, hname, hval);
  enum MHD_Result r = MHD_queue_response(conn, status, resp);
  MHD_destroy_response(resp);
  return r;
}

static enum MHD_Result send_text(struct MHD_Connection *conn, unsigned status, const char *text) {
  return send_reply(conn, status, "text/plain; charset=utf-8", text, strlen(text), NULL, NULL);
}

/* Count and answer a rejected request. The first rejection of each kind from
 * each peer host is logged at warn; repeats (a misconfigured peer retrying)
 * only count. A 404 is a normal answer to a decode asking too early, so it
 * logs at debug. */
static enum MHD_Result reject(kvf_bootstrap_server *srv, struct MHD_Connection *conn, int kind, unsigned status,
                              const char *method, const char *url, const char *why, const char *hname,
                              const char *hval) {
  atomic_fetch_add(&srv->errors[kind], 1);
  char peer[INET6_ADDRSTRLEN + 16];
  peer_name(conn, peer, sizeof peer);
  if (kind == ERR_NOT_FOUND) {
    LOG_DEBUG(COMP, "%s %s from %s: %u %s", method, url, peer, status, why);
  } else {
    /* Keyed on the host only: each connection comes from a new port. */
    if (kvf__log_first_time_for_host(peer, err_names[kind]))
      LOG_WARN(COMP, "rejected %s %s from %s: %u %s (further %s rejections from this host are only counted)",
               method, url, peer, status, why, err_names[kind]);
  }
  return send_reply(conn, status, "text/plain; charset=utf-8", why, strlen(why), hname, hval);
}

static int authorized(const kvf_bootstrap_server *srv, struct MHD_Connection *conn) {
  if (!srv->token) return 1;
  const char *h = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
  if (!h || strncasecmp(h, "Bearer ", 7)) return 0;
  h += 7;
  while (*h == ' ') h++;
  /* Constant-time so the reply time does not reveal how much of a guess
   * was right. */
  return kvf__ct_equal(srv->token, strlen(srv->token), h, strlen(h));
}

static void free_lists(route_lens *lists) {
  for (int i = 0; i < ROUTE_NLISTS; i++) {
    free(lists[i].v);
    memset(&lists[i], 0, sizeof lists[i]);
  }
}

static enum MHD_Result handle_put(kvf_bootstrap_server *srv, struct MHD_Connection *conn, request *rq,
                                  const char *url) {
  route_reg reg;
  char why[160];
  if (kvf__route_json_parse_put(rq->body, rq->len, &reg, why, sizeof why))
    return reject(srv, conn, ERR_BAD_REQUEST, MHD_HTTP_BAD_REQUEST, "PUT", url, why, NULL, NULL);

  pthread_mutex_lock(&srv->lock);
  if (srv->world_size < 0) {
    rank_entry *t = calloc((size_t)reg.world_size, sizeof *t);
    if (!t) {
      pthread_mutex_unlock(&srv->lock);
      kvf__route_reg_free(&reg);
      return send_text(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory");
    }
    srv->table = t;
    srv->world_size = reg.world_size;
    srv->dp_size = reg.dp_size;
    srv->tp = reg.world_size / reg.dp_size;
  } else if (reg.world_size != srv->world_size || reg.dp_size != srv->dp_size) {
    /* The reference keeps the first sizes but places the rank with the new
     * ones, which silently mis-files it; refusing tells the sender. */
    snprintf(why, sizeof why, "world_size %lld / dp_size %lld differ from the first registration (%lld / %lld)",
             (long long)reg.world_size, (long long)reg.dp_size, (long long)srv->world_size,
             (long long)srv->dp_size);
    pthread_mutex_unlock(&srv->lock);
    kvf__route_reg_free(&reg);
    return reject(srv, conn, ERR_CONFLICT, MHD_HTTP_CONFLICT, "PUT", url, why, NULL, NULL);
  }
  /* Extras: last writer wins, lists only when sent (as the reference). */
  srv->enable_mla_l1_5_cache = reg.enable_mla_l1_5_cache;
  for (int i = 0; i < ROUTE_NLISTS; i++) {
    if (!reg.lists[i].present) continue;
    free(srv->lists[i].v);
    srv->lists[i] = reg.lists[i];
    memset(&reg.lists[i], 0, sizeof reg.lists[i]);
  }
  if (kvf__route_reg_is_prefill(&reg)) {
    int64_t g = reg.engine_rank / srv->tp, t = reg.engine_rank % srv->tp;
    rank_entry *e = &srv->table[g * srv->tp + t];
    if (!e->set) srv->ranks_set++;
    e->set = 1;
    e->port = (int)reg.rank_port;
    memcpy(e->ip, reg.rank_ip, sizeof e->ip);
    LOG_INFO(COMP, "registered prefill rank %lld (dp group %lld, tp rank %lld) at %s", (long long)reg.engine_rank,
             (long long)g, (long long)t, kvf__addr_str(e->ip, (uint16_t)e->port).s);
  }
  pthread_mutex_unlock(&srv->lock);
  kvf__route_reg_free(&reg);
  atomic_fetch_add(&srv->registrations, 1);
  return send_text(conn, MHD_HTTP_OK, "OK");
}

static enum MHD_Result reply_json(struct MHD_Connection *conn, char *json) {
  if (!json) return send_text(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory");
  enum MHD_Result r =
      send_reply(conn, MHD_HTTP_OK, "application/json; charset=utf-8", json, strlen(json), NULL, NULL);
  free(json);
  return r;
}

static enum MHD_Result handle_get_route(kvf_bootstrap_server *srv, struct MHD_Connection *conn, const char *method,
                                        const char *url) {
  const char *rs = MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, "engine_rank");
  const char *gs = MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, "target_dp_group");
  if (!rs || !*rs || !gs || !*gs)
    return reject(srv, conn, ERR_BAD_REQUEST, MHD_HTTP_BAD_REQUEST, method, url,
                  "Missing inputs for bootstrap server.", NULL, NULL);
  int64_t t, g;
  if (kvf__route_parse_int(rs, strlen(rs), &t) || kvf__route_parse_int(gs, strlen(gs), &g))
    return reject(srv, conn, ERR_BAD_REQUEST, MHD_HTTP_BAD_REQUEST, method, url,
                  "engine_rank and target_dp_group must be integers", NULL, NULL);

  char *json = NULL;
  if (t == -1 && g == -1) {
    route_parallel_info p;
    memset(&p, 0, sizeof p);
    pthread_mutex_lock(&srv->lock);
    p.world_size = srv->world_size;
    p.dp_size = srv->dp_size;
    p.enable_mla_l1_5_cache = srv->enable_mla_l1_5_cache;
    memcpy(p.lists, srv->lists, sizeof p.lists); /* borrowed for the encode only */
    json = kvf__route_json_encode_parallel_info(&p);
    pthread_mutex_unlock(&srv->lock);
    atomic_fetch_add(&srv->parallel_infos, 1);
    return reply_json(conn, json);
  }

  int found = 0;
  pthread_mutex_lock(&srv->lock);
  if (srv->table && g >= 0 && g < srv->dp_size && t >= 0 && t < srv->tp) {
    const rank_entry *e = &srv->table[g * srv->tp + t];
    if (e->set) {
      found = 1;
      json = kvf__route_json_encode_rank(e->ip, e->port);
    }
  }
  pthread_mutex_unlock(&srv->lock);
  if (!found)
    return reject(srv, conn, ERR_NOT_FOUND, MHD_HTTP_NOT_FOUND, method, url, "Bootstrap info not Found", NULL,
                  NULL);
  atomic_fetch_add(&srv->lookups, 1);
  return reply_json(conn, json);
}

/* Bounds of a GET /metrics page: the whole page, and what one source
 * (kvf_bootstrap_server_add_metrics) or one engine's peer routes may write.
 * A manager writes ~15 KiB; routes take ~120 bytes a peer. */
#define METRICS_PAGE_MAX (4u << 20)
#define METRICS_PART_MAX (1u << 20)
#define METRICS_PART_FIRST 16384

static void counter(mtext *t, const char *name, const char *help, atomic_uint_fast64_t *v) {
  kvf__mtext_appendf(t, "# HELP %s %s\n# TYPE %s counter\n%s %llu\n", name, help, name, name,
                     (unsigned long long)atomic_load(v));
}

/* A label value: quotes, backslashes and newlines escaped. */
static void append_label(mtext *t, const char *v, size_t len) {
  for (size_t i = 0; i < len; i++) {
    char c = v[i];
    if (c == '"' || c == '\\') kvf__mtext_appendf(t, "\\%c", c);
    else if (c == '\n') kvf__mtext_append(t, "\\n", 2);
    else kvf__mtext_append(t, &c, 1);
  }
}

/* Call fill(arg, buf, cap) with a buffer that grows (doubling from
 * METRICS_PART_FIRST to METRICS_PART_MAX) while what it wrote comes within a
 * line of the end: fill functions write whole lines and drop what does not
 * fit. The caller frees the result; NULL without memory. */
static char *fill_grown(size_t (*fill)(void *arg, char *buf, size_t cap), void *arg, size_t *len) {
  enum { LINE_MAX_GUESS = 1024 };
  char *buf = NULL;
  for (size_t cap = METRICS_PART_FIRST; cap <= METRICS_PART_MAX; cap *= 2) {
    char *b = realloc(buf, cap);
    if (!b) break;
    buf = b;
    buf[0] = '\0';
    size_t n = fill(arg, buf, cap);
    *len = n < cap ? n : cap - 1;
    if (*len + LINE_MAX_GUESS < cap || cap == METRICS_PART_MAX) return buf;
  }
  free(buf);
  return NULL;
}

static size_t routes_fill(void *engine, char *buf, size_t cap) {
  int lines = kvf_engine_peer_routes(engine, buf, cap);
  return lines > 0 ? strlen(buf) : 0;
}

/* kvferry_engine_peer_route{engine,peer,transport,why} 1 per engine peer. */
static void engine_routes(kvf_bootstrap_server *srv, mtext *t) {
  kvf__mtext_appendf(t, "# HELP kvferry_engine_peer_route The transport each engine chose for a peer, and why.\n"
                        "# TYPE kvferry_engine_peer_route gauge\n");
  pthread_mutex_lock(&srv->lock);
  for (int i = 0; i < srv->nengines; i++) {
    size_t len = 0;
    char *lines = fill_grown(routes_fill, srv->engines[i], &len);
    const char *self = kvf_engine_session_id(srv->engines[i]);
    for (char *l = lines, *nl; l && *l; l = nl + 1) {
      if (!(nl = strchr(l, '\n'))) break;
      char *sp1 = memchr(l, ' ', (size_t)(nl - l)),
           *sp2 = sp1 ? memchr(sp1 + 1, ' ', (size_t)(nl - sp1 - 1)) : NULL;
      if (!sp2) continue;
      kvf__mtext_appendf(t, "kvferry_engine_peer_route{engine=\"");
      append_label(t, self, strlen(self));
      kvf__mtext_appendf(t, "\",peer=\"");
      append_label(t, l, (size_t)(sp1 - l));
      kvf__mtext_appendf(t, "\",transport=\"");
      append_label(t, sp1 + 1, (size_t)(sp2 - sp1 - 1));
      kvf__mtext_appendf(t, "\",why=\"");
      append_label(t, sp2 + 1, (size_t)(nl - sp2 - 1));
      kvf__mtext_appendf(t, "\"} 1\n");
    }
    free(lines);
  }
  pthread_mutex_unlock(&srv->lock);
}

int kvf_bootstrap_server_add_engine(kvf_bootstrap_server *srv, kvf_engine *engine) {
  if (!srv || !engine) return KVF_EINVAL;
  int rc = 0;
  pthread_mutex_lock(&srv->lock);
  if (srv->nengines == KVF_BOOTSTRAP_MAX_ENGINES) rc = KVF_ENOMEM;
  else srv->engines[srv->nengines++] = engine;
  pthread_mutex_unlock(&srv->lock);
  return rc;
}

int kvf_bootstrap_server_add_metrics(kvf_bootstrap_server *srv, kvf_metrics_fn fn, void *arg) {
  if (!srv || !fn) return KVF_EINVAL;
  int rc = 0;
  pthread_mutex_lock(&srv->lock);
  if (srv->nsources == KVF_BOOTSTRAP_MAX_SOURCES) {
    rc = KVF_ENOMEM;
  } else {
    srv->sources[srv->nsources] = fn;
    srv->source_args[srv->nsources++] = arg;
  }
  pthread_mutex_unlock(&srv->lock);
  return rc;
}

/* A source and its argument, for fill_grown. */
typedef struct source_call {
  kvf_metrics_fn fn;
  void *arg;
} source_call;

static size_t source_fill(void *call, char *buf, size_t cap) {
  const source_call *c = call;
  return c->fn(c->arg, buf, cap);
}

/* The lines of kvf_bootstrap_server_add_metrics' sources, grouped by family
 * (several managers write the same families: each must appear once). */
static void source_lines(kvf_bootstrap_server *srv, mtext *t) {
  mtext all;
  kvf__mtext_init(&all, METRICS_PAGE_MAX);
  pthread_mutex_lock(&srv->lock);
  for (int i = 0; i < srv->nsources; i++) {
    source_call c = {srv->sources[i], srv->source_args[i]};
    size_t len = 0;
    char *lines = fill_grown(source_fill, &c, &len);
    if (lines) kvf__mtext_append(&all, lines, len);
    free(lines);
  }
  pthread_mutex_unlock(&srv->lock);
  kvf__mtext_finish(&all);
  kvf__metrics_group(all.buf, all.n, t);
  kvf__mtext_free(&all);
}

static enum MHD_Result handle_metrics(kvf_bootstrap_server *srv, struct MHD_Connection *conn) {
  mtext page;
  kvf__mtext_init(&page, METRICS_PAGE_MAX);
  pthread_mutex_lock(&srv->lock);
  long long ranks = (long long)srv->ranks_set, world = (long long)srv->world_size;
  pthread_mutex_unlock(&srv->lock);
  counter(&page, "kvferry_bootstrap_registrations_total", "Accepted PUT /route registrations.",
          &srv->registrations);
  counter(&page, "kvferry_bootstrap_lookups_total", "Answered rank lookups.", &srv->lookups);
  counter(&page, "kvferry_bootstrap_parallel_info_total", "Answered parallel-info requests.",
          &srv->parallel_infos);
  counter(&page, "kvferry_bootstrap_health_checks_total", "Answered /health probes.", &srv->health_checks);
  kvf__mtext_appendf(&page, "# HELP kvferry_bootstrap_errors_total Rejected requests by kind.\n"
                            "# TYPE kvferry_bootstrap_errors_total counter\n");
  for (int k = 0; k < ERR_NKINDS; k++)
    kvf__mtext_appendf(&page, "kvferry_bootstrap_errors_total{kind=\"%s\"} %llu\n", err_names[k],
                       (unsigned long long)atomic_load(&srv->errors[k]));
  kvf__mtext_appendf(&page,
                     "# HELP kvferry_bootstrap_registered_ranks Prefill ranks in the routing table.\n"
                     "# TYPE kvferry_bootstrap_registered_ranks gauge\n"
                     "kvferry_bootstrap_registered_ranks %lld\n"
                     "# HELP kvferry_bootstrap_world_size Prefill world size from the first registration (-1 "
                     "before).\n"
                     "# TYPE kvferry_bootstrap_world_size gauge\n"
                     "kvferry_bootstrap_world_size %lld\n",
                     ranks, world);
  engine_routes(srv, &page);
  source_lines(srv, &page);
  kvf__mtext_finish(&page);
  if (!page.buf) return send_text(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory");
  enum MHD_Result r =
      send_reply(conn, MHD_HTTP_OK, "text/plain; version=0.0.4; charset=utf-8", page.buf, page.n, NULL, NULL);
  kvf__mtext_free(&page);
  return r;
}

/* ---- connection tracking ---- */

static conn_track *track_of(struct MHD_Connection *conn) {
  const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
  return ci ? ci->socket_context : NULL;
}

/* Shut a tracked connection down; MHD sees the end of the stream and closes
 * it (and sends CLOSED) on its own thread. Caller holds conns_lock, so the
 * descriptor is still open. kind < 0: an idle keep-alive connection, closed
 * without counting it as an error. */
static void cut_locked(kvf_bootstrap_server *srv, conn_track *c, int kind) {
  if (c->cut) return;
  c->cut = 1;
  shutdown(c->fd, SHUT_RDWR);
  if (kind < 0) return;
  atomic_fetch_add(&srv->errors[kind], 1);
  if (kvf__log_first_time(kvf__hash_str(err_names[kind], 0xb0c1ULL)))
    LOG_WARN(COMP, "%s (further such connections are only counted in /metrics)",
             kind == ERR_SLOW
                 ? "closed a connection whose request was not complete within the deadline"
                 : "connection slots nearly full: closed the oldest connection still sending a request");
}

static void on_connection(void *cls, struct MHD_Connection *conn, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe) {
  kvf_bootstrap_server *srv = cls;
  conn_track *c = *socket_context;
  pthread_mutex_lock(&srv->conns_lock);
  if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    c = ci ? calloc(1, sizeof *c) : NULL;
    if (c) {
      c->fd = ci->connect_fd;
      c->since_ns = clock_now_ns();
      c->next = srv->conns.next;
      c->prev = &srv->conns;
      c->next->prev = c;
      srv->conns.next = c;
      srv->nconns++;
      *socket_context = c;
      if (srv->guard_sleeping) pthread_cond_signal(&srv->guard_cv); /* its deadline is watched from now */
    }
    if (srv->nconns + srv->free_slots > srv->max_conns) {
      /* The oldest still waiting for headers (or idle between requests);
       * failing that, the oldest request (a body or a reply that trickles:
       * a live one takes milliseconds). Either way the deadline would cut
       * it soon. A connection accepted within EVICT_GRACE_MS is not yet
       * late with its headers: a request running longer goes first, so a
       * flood of slow bodies cannot make new clients evict each other. */
      conn_track *victim = NULL, *busy = NULL;
      int64_t grace_from = clock_now_ns() - (int64_t)EVICT_GRACE_MS * 1000000;
      for (conn_track *o = srv->conns.next; o != &srv->conns; o = o->next) {
        if (o == c || o->cut) continue;
        conn_track **best = o->in_request ? &busy : &victim;
        if (!*best || o->since_ns < (*best)->since_ns) *best = o;
      }
      if (victim && busy && victim->since_ns > grace_from && busy->since_ns < victim->since_ns) victim = NULL;
      if (victim || busy) cut_locked(srv, victim ? victim : busy, ERR_EVICTED);
    }
  } else if (c) {
    c->prev->next = c->next;
    c->next->prev = c->prev;
    srv->nconns--;
    free(c);
    *socket_context = NULL;
  }
  pthread_mutex_unlock(&srv->conns_lock);
}

/* The headers of a request are in (first handler call). */
static void track_request_started(kvf_bootstrap_server *srv, struct MHD_Connection *conn) {
  conn_track *c = track_of(conn);
  if (!c) return;
  pthread_mutex_lock(&srv->conns_lock);
  c->in_request = 1;
  pthread_mutex_unlock(&srv->conns_lock);
}

/* The guard cuts connections past their deadline. It sleeps until the
 * earliest deadline of a tracked connection, or, with none, until one is
 * tracked (on_connection signals it): an idle server costs no wake-ups. */
static void *guard_main(void *arg) {
  kvf__thread_name("kvf-bs-guard");
  kvf_bootstrap_server *srv = arg;
  pthread_mutex_lock(&srv->conns_lock);
  while (!srv->stopping) {
    int64_t now = clock_now_ns(), next = INT64_MAX;
    for (conn_track *c = srv->conns.next; c != &srv->conns; c = c->next) {
      if (c->cut) continue;
      if (now - c->since_ns > srv->deadline_ns) cut_locked(srv, c, c->served && !c->in_request ? -1 : ERR_SLOW);
      else if (c->since_ns + srv->deadline_ns < next) next = c->since_ns + srv->deadline_ns;
    }
    if (next == INT64_MAX) {
      srv->guard_sleeping = 1;
      pthread_cond_wait(&srv->guard_cv, &srv->conns_lock);
      srv->guard_sleeping = 0;
    } else {
      struct timespec ts = clock_ts_from_ns(next + GUARD_SLACK_MS * 1000000LL);
      pthread_cond_timedwait(&srv->guard_cv, &srv->conns_lock, &ts);
    }
  }
  pthread_mutex_unlock(&srv->conns_lock);
  return NULL;
}

static void stop_guard(kvf_bootstrap_server *srv) {
  pthread_mutex_lock(&srv->conns_lock);
  srv->stopping = 1;
  pthread_cond_signal(&srv->guard_cv);
  pthread_mutex_unlock(&srv->conns_lock);
  pthread_join(srv->guard, NULL);
}

static int endpoint_of(const char *url) {
  if (!strcmp(url, "/route")) return EP_ROUTE;
  if (!strcmp(url, "/health")) return EP_HEALTH;
  if (!strcmp(url, "/metrics")) return EP_METRICS;
  return EP_UNKNOWN;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                                  const char *version, const char *upload_data, size_t *upload_data_size,
                                  void **con_cls) {
  kvf_bootstrap_server *srv = cls;
  request *rq = *con_cls;
  int is_get = !strcmp(method, MHD_HTTP_METHOD_GET), is_head = !strcmp(method, MHD_HTTP_METHOD_HEAD);
  int is_put = !strcmp(method, MHD_HTTP_METHOD_PUT);

  if (!rq) {
    /* First call: headers only. Everything that can be decided without the
     * body is decided here, so a refused upload is never read. */
    rq = calloc(1, sizeof *rq);
    if (!rq) return MHD_NO;
    *con_cls = rq;
    track_request_started(srv, conn);
    rq->endpoint = endpoint_of(url);
    if (rq->endpoint == EP_UNKNOWN) {
      rq->replied = 1;
      return reject(srv, conn, ERR_NOT_FOUND, MHD_HTTP_NOT_FOUND, method, url, "Not Found", NULL, NULL);
    }
    int allowed = is_get || is_head || (is_put && rq->endpoint == EP_ROUTE);
    if (!allowed) {
      rq->replied = 1;
      return reject(srv, conn, ERR_METHOD, MHD_HTTP_METHOD_NOT_ALLOWED, method, url, "Method not allowed",
                    MHD_HTTP_HEADER_ALLOW, rq->endpoint == EP_ROUTE ? "GET, HEAD, PUT" : "GET, HEAD");
    }
    if (is_put && !authorized(srv, conn)) {
      rq->replied = 1;
      return reject(srv, conn, ERR_UNAUTHORIZED, MHD_HTTP_UNAUTHORIZED, method, url,
                    "missing or wrong bearer token", MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    }
    const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    int64_t declared;
    if (cl && kvf__route_parse_int(cl, strlen(cl), &declared) == 0 && declared > (int64_t)srv->max_body) {
      rq->replied = 1;
      return reject(srv, conn, ERR_TOO_LARGE, MHD_HTTP_CONTENT_TOO_LARGE, method, url, "body too large", NULL,
                    NULL);
    }
    return MHD_YES;
  }

  if (rq->replied) {
    *upload_data_size = 0;
    return MHD_YES;
  }
  if (*upload_data_size) {
    size_t n = *upload_data_size;
    if (n > srv->max_body - rq->len) {
      /* A chunked body with no Content-Length grew past the bound. MHD can
       * only queue a reply once the upload is complete, so drop the
       * connection: nothing more of this body is read or buffered. */
      atomic_fetch_add(&srv->errors[ERR_TOO_LARGE], 1);
      char peer[INET6_ADDRSTRLEN + 16];
      peer_name(conn, peer, sizeof peer);
      if (kvf__log_first_time_for_host(peer, "bootstrap-body-too-large"))
        LOG_WARN(COMP, "closed connection from %s: %s %s body over %zu bytes", peer, method, url, srv->max_body);
      return MHD_NO;
    }
    char *b = realloc(rq->body, rq->len + n + 1);
    if (!b) return MHD_NO;
    memcpy(b + rq->len, upload_data, n);
    rq->body = b;
    rq->len += n;
    rq->body[rq->len] = '\0';
    *upload_data_size = 0;
    return MHD_YES;
  }

  /* Last call: the whole request is here. */
  switch (rq->endpoint) {
    case EP_HEALTH: atomic_fetch_add(&srv->health_checks, 1); return send_text(conn, MHD_HTTP_OK, "OK");
    case EP_METRICS: return handle_metrics(srv, conn);
    default: return is_put ? handle_put(srv, conn, rq, url) : handle_get_route(srv, conn, method, url);
  }
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
  kvf_bootstrap_server *srv = cls;
  conn_track *c = track_of(conn);
  if (c) { /* the next request on this connection has its own deadline */
    pthread_mutex_lock(&srv->conns_lock);
    c->in_request = 0;
    c->served = 1;
    c->since_ns = clock_now_ns();
    pthread_mutex_unlock(&srv->conns_lock);
  }
  request *rq = *con_cls;
  if (!rq) return;
  free(rq->body);
  free(rq);
  *con_cls = NULL;
}

static void mhd_log(void *cls, const char *fmt, va_list ap) {
  char msg[512];
  vsnprintf(msg, sizeof msg, fmt, ap);
  size_t n = strlen(msg);
  while (n && (msg[n - 1] == '\n' || msg[n - 1] == '\r')) msg[--n] = '\0';
  LOG_INFO(COMP, "libmicrohttpd: %s", msg);
}

static int resolve_bind(const char *host, uint16_t port, struct sockaddr_storage *ss) {
  struct addrinfo hints, *res = NULL;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  char serv[8];
  snprintf(serv, sizeof serv, "%u", (unsigned)port);
  int rc = getaddrinfo(host, serv, &hints, &res);
  if (rc || !res) {
    LOG_ERROR(COMP, "cannot resolve bind host '%s': %s", host, gai_strerror(rc));
    return KVF_EINVAL;
  }
  memcpy(ss, res->ai_addr, res->ai_addrlen);
  freeaddrinfo(res);
  return 0;
}

static const kvf__field server_fields[] = {
    KVF__FIELD(kvf_bootstrap_server_config, host, KVF__FIELD_STR),
    KVF__FIELD(kvf_bootstrap_server_config, port, KVF__FIELD_U16),
    KVF__FIELD(kvf_bootstrap_server_config, auth_token, KVF__FIELD_STR),
    KVF__FIELD(kvf_bootstrap_server_config, max_body, KVF__FIELD_SIZE),
    KVF__FIELD(kvf_bootstrap_server_config, max_conns, KVF__FIELD_UINT),
    KVF__FIELD(kvf_bootstrap_server_config, idle_timeout_s, KVF__FIELD_UINT),
};

int kvf_bootstrap_server_config_set(kvf_bootstrap_server_config *cfg, const char *name, const char *value) {
  return kvf__config_set(cfg, KVF_BOOTSTRAP_SERVER_CONFIG_SIZE_V1, sizeof *cfg, server_fields,
                         sizeof server_fields / sizeof server_fields[0], name, value);
}

int kvf_bootstrap_server_create(const kvf_bootstrap_server_config *cfg_in, kvf_bootstrap_server **out) {
  kvf_bootstrap_server_config cfg;
  kvf_bootstrap_server_config_init(&cfg);
  if (!out || (cfg_in && kvf__config_copy(&cfg, sizeof cfg, cfg_in, KVF_BOOTSTRAP_SERVER_CONFIG_SIZE_V1)))
    return KVF_EINVAL;
  if (!cfg.host || !*cfg.host) cfg.host = "0.0.0.0";
  if (!cfg.max_body) cfg.max_body = DEFAULT_MAX_BODY;
  if (!cfg.max_conns) cfg.max_conns = DEFAULT_MAX_CONNS;
  if (!cfg.idle_timeout_s) cfg.idle_timeout_s = DEFAULT_IDLE_S;
  const char *token = cfg.auth_token ? cfg.auth_token : getenv("KVFERRY_BOOTSTRAP_TOKEN");

  int rc = KVF_ENOMEM;
  kvf_bootstrap_server *srv = calloc(1, sizeof *srv);
  if (!srv) return KVF_ENOMEM;
  srv->max_body = cfg.max_body;
  srv->world_size = srv->dp_size = srv->tp = -1;
  if (token && *token && !(srv->token = strdup(token))) goto err_free_srv;
  if (pthread_mutex_init(&srv->lock, NULL)) {
    rc = KVF_EIO;
    goto err_free_token;
  }
  pthread_mutex_init(&srv->conns_lock, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&srv->guard_cv, &ca);
  pthread_condattr_destroy(&ca);
  srv->conns.next = srv->conns.prev = &srv->conns;
  srv->max_conns = cfg.max_conns;
  srv->free_slots = cfg.max_conns / 8 < MIN_FREE_SLOTS ? cfg.max_conns / 8 : MIN_FREE_SLOTS;
  if (srv->free_slots < 1) srv->free_slots = 1;
  unsigned deadline_s = cfg.idle_timeout_s < REQUEST_DEADLINE_S ? cfg.idle_timeout_s : REQUEST_DEADLINE_S;
  srv->deadline_ns = (int64_t)deadline_s * 1000000000LL;
  if (pthread_create(&srv->guard, NULL, guard_main, srv)) {
    rc = KVF_ENOMEM;
    goto err_destroy_lock;
  }

  struct sockaddr_storage ss;
  if ((rc = resolve_bind(cfg.host, cfg.port, &ss))) goto err_stop_guard;
  /* epoll: no FD_SETSIZE ceiling, and cost per ready connection only. */
  unsigned flags = MHD_USE_EPOLL_INTERNAL_THREAD | MHD_USE_ERROR_LOG;
  if (ss.ss_family == AF_INET6) flags |= MHD_USE_IPv6;
  srv->mhd = MHD_start_daemon(flags, cfg.port, NULL, NULL, on_request, srv, MHD_OPTION_SOCK_ADDR,
                              (struct sockaddr *)&ss, MHD_OPTION_CONNECTION_LIMIT, (unsigned)cfg.max_conns,
                              MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)cfg.idle_timeout_s,
                              MHD_OPTION_NOTIFY_COMPLETED, on_completed, srv, MHD_OPTION_NOTIFY_CONNECTION,
                              on_connection, srv, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, srv, MHD_OPTION_END);
  if (!srv->mhd) {
    LOG_ERROR(COMP, "cannot listen on %s (port in use or address not local?)",
              kvf__addr_str(cfg.host, cfg.port).s);
    rc = KVF_EIO;
    goto err_stop_guard;
  }
  const union MHD_DaemonInfo *di = MHD_get_daemon_info(srv->mhd, MHD_DAEMON_INFO_BIND_PORT);
  srv->port = di && di->port ? di->port : cfg.port;
  LOG_INFO(COMP, "listening on %s%s", kvf__addr_str(cfg.host, srv->port).s,
           srv->token ? " (PUT needs a token)" : "");
  *out = srv;
  return 0;

err_stop_guard:
  stop_guard(srv);
err_destroy_lock:
  pthread_mutex_destroy(&srv->conns_lock);
  pthread_cond_destroy(&srv->guard_cv);
  pthread_mutex_destroy(&srv->lock);
err_free_token:
  free(srv->token);
err_free_srv:
  free(srv);
  return rc;
}

uint16_t kvf_bootstrap_server_port(const kvf_bootstrap_server *srv) { return srv ? srv->port : 0; }

void kvf_bootstrap_server_destroy(kvf_bootstrap_server *srv) {
  if (!srv) return;
  stop_guard(srv); /* first: it must not shut down descriptors MHD is closing */
  MHD_stop_daemon(srv->mhd);
  free(srv->table);
  free_lists(srv->lists);
  pthread_mutex_destroy(&srv->conns_lock);
  pthread_cond_destroy(&srv->guard_cv);
  pthread_mutex_destroy(&srv->lock);
  free(srv->token);
  free(srv);
}
