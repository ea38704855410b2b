/* The bootstrap HTTP client on libcurl: registration (PUT /route, retried
 * until a deadline), discovery (parallel info, rank lookup) and the /health
 * heartbeat. Every request has a connect and a total timeout — the
 * reference's parallel-info GET has none and can hang the scheduler
 * (PROTOCOL §8.2). One easy handle per client keeps its connection alive
 * between requests. Proxies from the environment are ignored: the bootstrap
 * server is a peer in the same cluster, and a proxy would only stand between
 * two ranks that can reach each other. */
#include <curl/curl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/addr.h"
#include "base/clock.h"
#include "base/env.h"
#include "base/log.h"
#include "bootstrap/bootstrap.h"

#define COMP "bootstrap"
#define DEFAULT_CONNECT_MS 2000
#define DEFAULT_TIMEOUT_MS 5000
#define BACKOFF_FIRST_MS 50
#define BACKOFF_MAX_MS 1000

struct bootstrap_client {
  CURL *curl;
  char *addr;
  char *base; /* "http://<addr>" */
  char *auth; /* "Authorization: Bearer <token>", NULL without a token */
  int connect_timeout_ms, timeout_ms;
  int64_t until_ns;    /* kvf__bootstrap_client_set_deadline; 0: none */
  int (*stop)(void *); /* kvf__bootstrap_client_set_stop; NULL: none */
  void *stop_arg;
  /* Reply of the request in progress. */
  char *buf;
  size_t len, cap;
  int overflow;
  char errbuf[CURL_ERROR_SIZE];
};

static pthread_once_t g_curl_once = PTHREAD_ONCE_INIT;
static CURLcode g_curl_init_rc = CURLE_FAILED_INIT;

/* curl_global_init is not thread-safe and must run once per process. */
static void curl_init_once(void) { g_curl_init_rc = curl_global_init(CURL_GLOBAL_DEFAULT); }

/* A bootstrap address goes into a URL verbatim; the address parser refuses
 * anything that would change the URL's meaning (path, query, credentials,
 * spaces) and a bare IPv6 host. */
static int addr_valid(const char *addr) {
  return addr && !kvf__addr_parse(addr, strlen(addr), NULL, 0, NULL, NULL);
}

int kvf__bootstrap_client_create(const char *addr, const bootstrap_client_opts *opts, bootstrap_client **out) {
  if (!out || !addr_valid(addr)) {
    LOG_ERROR(COMP, "bad bootstrap address '%s'", addr ? addr : "(null)");
    return KVF_EINVAL;
  }
  pthread_once(&g_curl_once, curl_init_once);
  if (g_curl_init_rc != CURLE_OK) {
    LOG_ERROR(COMP, "libcurl initialisation failed: %s", curl_easy_strerror(g_curl_init_rc));
    return KVF_EIO;
  }
  int rc = KVF_ENOMEM;
  bootstrap_client *c = calloc(1, sizeof *c);
  if (!c) return KVF_ENOMEM;
  c->connect_timeout_ms = opts && opts->connect_timeout_ms > 0 ? opts->connect_timeout_ms : DEFAULT_CONNECT_MS;
  c->timeout_ms = opts && opts->timeout_ms > 0
                      ? opts->timeout_ms
                      : (int)kvf__env_get_int("KVFERRY_BOOTSTRAP_TIMEOUT_MS", DEFAULT_TIMEOUT_MS);
  if (c->timeout_ms <= 0) c->timeout_ms = DEFAULT_TIMEOUT_MS;
  const char *token = opts && opts->token ? opts->token : getenv("KVFERRY_BOOTSTRAP_TOKEN");

  if (!(c->addr = strdup(addr))) goto err_free_client;
  size_t n = strlen(addr) + sizeof "http://";
  if (!(c->base = malloc(n))) goto err_free_addr;
  snprintf(c->base, n, "http://%s", addr);
  if (token && *token) {
    size_t m = strlen(token) + sizeof "Authorization: Bearer ";
    if (!(c->auth = malloc(m))) goto err_free_base;
    snprintf(c->auth, m, "Authorization: Bearer %s", token);
  }
  if (!(c->curl = curl_easy_init())) {
    rc = KVF_EIO;
    goto err_free_auth;
  }
  *out = c;
  return 0;

err_free_auth:
  free(c->auth);
err_free_base:
  free(c->base);
err_free_addr:
  free(c->addr);
err_free_client:
  free(c);
  return rc;
}

void kvf__bootstrap_client_set_stop(bootstrap_client *c, int (*stop)(void *arg), void *arg) {
  if (!c) return;
  c->stop = stop;
  c->stop_arg = arg;
}

/* libcurl's progress callback, on the caller's thread: nonzero aborts. */
static int on_progress(void *arg, curl_off_t dltotal, curl_off_t dlnow, curl_off_t ultotal, curl_off_t ulnow) {
  (void)dltotal, (void)dlnow, (void)ultotal, (void)ulnow;
  bootstrap_client *c = arg;
  return c->stop(c->stop_arg);
}

void kvf__bootstrap_client_set_deadline(bootstrap_client *c, int64_t until_ns) {
  if (c) c->until_ns = until_ns;
}

void kvf__bootstrap_client_destroy(bootstrap_client *c) {
  if (!c) return;
  curl_easy_cleanup(c->curl);
  free(c->buf);
  free(c->auth);
  free(c->base);
  free(c->addr);
  free(c);
}

static size_t on_data(char *ptr, size_t size, size_t nmemb, void *userdata) {
  bootstrap_client *c = userdata;
  size_t n = size * nmemb;
  if (n > BOOTSTRAP_MAX_REPLY - c->len) {
    c->overflow = 1;
    return 0; /* makes curl fail the transfer with CURLE_WRITE_ERROR */
  }
  if (c->len + n + 1 > c->cap) {
    size_t cap = c->cap ? c->cap : 1024;
    while (cap < c->len + n + 1) cap *= 2;
    char *b = realloc(c->buf, cap);
    if (!b) return 0;
    c->buf = b;
    c->cap = cap;
  }
  memcpy(c->buf + c->len, ptr, n);
  c->len += n;
  c->buf[c->len] = '\0';
  return n;
}

static int map_curl_error(CURLcode cc) {
  switch (cc) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_COULDNT_RESOLVE_HOST: return KVF_ECONNREFUSED;
    case CURLE_OPERATION_TIMEDOUT: return KVF_ETIMEDOUT;
    case CURLE_GOT_NOTHING:
    case CURLE_RECV_ERROR:
    case CURLE_SEND_ERROR:
    case CURLE_PARTIAL_FILE: return KVF_ECLOSED;
    case CURLE_ABORTED_BY_CALLBACK: return KVF_ESTATE; /* kvf__bootstrap_client_set_stop */
    case CURLE_OUT_OF_MEMORY: return KVF_ENOMEM;
    case CURLE_WRITE_ERROR:
    case CURLE_WEIRD_SERVER_REPLY:
    case CURLE_UNSUPPORTED_PROTOCOL: return KVF_EPROTO;
    default: return KVF_EIO;
  }
}

static int map_status(long status) {
  switch (status) {
    case 200: return 0;
    case 400: return KVF_EINVAL;
    case 401:
    case 403: return KVF_EACCES;
    case 404: return KVF_ENOTFOUND;
    case 409: return KVF_ESTATE;
    case 413: return KVF_ETOOBIG;
    default: return status >= 500 ? KVF_EIO : KVF_EPROTO;
  }
}

/* One exchange with explicit timeouts (the PUT retry loop shrinks them to fit
 * its deadline). Leaves the reply in c->buf/c->len. */
static int perform(bootstrap_client *c, const char *method, const char *path, const char *body, size_t body_len,
                   int connect_ms, int total_ms, long *status) {
  CURL *h = c->curl;
  if (c->stop && c->stop(c->stop_arg)) return KVF_ESTATE;
  if (c->until_ns) { /* the caller's overall deadline caps this request */
    int64_t left_ms = (c->until_ns - clock_now_ns()) / 1000000;
    if (left_ms <= 0) return KVF_ETIMEDOUT;
    if (total_ms > left_ms) total_ms = (int)left_ms;
    if (connect_ms > total_ms) connect_ms = total_ms;
  }
  c->len = 0;
  c->overflow = 0;
  c->errbuf[0] = '\0';
  if (c->buf) c->buf[0] = '\0';

  size_t ulen = strlen(c->base) + strlen(path) + 1;
  char *url = malloc(ulen);
  if (!url) return KVF_ENOMEM;
  snprintf(url, ulen, "%s%s", c->base, path);

  int is_put = !strcmp(method, "PUT");
  struct curl_slist *hdrs = NULL, *tmp;
  /* "Expect:" stops curl from waiting for 100-continue on bodies over 1 KiB. */
  const char *lines[] = {"Expect:", body ? "Content-Type: application/json" : NULL, is_put ? c->auth : NULL};
  for (size_t i = 0; i < sizeof lines / sizeof lines[0]; i++) {
    if (!lines[i]) continue;
    if (!(tmp = curl_slist_append(hdrs, lines[i]))) {
      curl_slist_free_all(hdrs);
      free(url);
      return KVF_ENOMEM;
    }
    hdrs = tmp;
  }

  /* Reset keeps the connection cache, so keep-alive survives between calls. */
  curl_easy_reset(h);
  curl_easy_setopt(h, CURLOPT_URL, url);
  curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, (long)connect_ms);
  curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)total_ms);
  curl_easy_setopt(h, CURLOPT_NOPROXY, "*");
#if LIBCURL_VERSION_NUM >= 0x075500
  curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http");
#endif
  curl_easy_setopt(h, CURLOPT_TCP_NODELAY, 1L);
  curl_easy_setopt(h, CURLOPT_HTTPHEADER, hdrs);
  curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_data);
  curl_easy_setopt(h, CURLOPT_WRITEDATA, c);
  curl_easy_setopt(h, CURLOPT_ERRORBUFFER, c->errbuf);
  if (c->stop) {
    curl_easy_setopt(h, CURLOPT_XFERINFOFUNCTION, on_progress);
    curl_easy_setopt(h, CURLOPT_XFERINFODATA, c);
    curl_easy_setopt(h, CURLOPT_NOPROGRESS, 0L);
  }
  if (!strcmp(method, "GET")) {
    curl_easy_setopt(h, CURLOPT_HTTPGET, 1L);
  } else if (!strcmp(method, "HEAD")) {
    curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
  } else {
    curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, method);
  }
  if (body) {
    curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)body_len);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
  }

  CURLcode cc = curl_easy_perform(h);
  int rc = 0;
  if (cc != CURLE_OK) {
    rc = c->overflow ? KVF_EPROTO : map_curl_error(cc);
    LOG_DEBUG(COMP, "%s %s: %s", method, url, c->errbuf[0] ? c->errbuf : curl_easy_strerror(cc));
  } else {
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, status);
  }
  /* The handle keeps pointers to these until the next request's reset. */
  curl_easy_setopt(h, CURLOPT_HTTPHEADER, NULL);
  curl_easy_setopt(h, CURLOPT_POSTFIELDS, NULL);
  curl_slist_free_all(hdrs);
  free(url);
  return rc;
}

int kvf__bootstrap_client_request(bootstrap_client *c, const char *method, const char *path, const char *body,
                                  size_t body_len, long *status, char **reply, size_t *reply_len) {
  if (!c || !method || !path || path[0] != '/' || !status) return KVF_EINVAL;
  long st = 0;
  int rc = perform(c, method, path, body, body_len, c->connect_timeout_ms, c->timeout_ms, &st);
  if (rc) return rc;
  if (reply) {
    char *copy = malloc(c->len + 1);
    if (!copy) return KVF_ENOMEM;
    if (c->len) memcpy(copy, c->buf, c->len);
    copy[c->len] = '\0';
    *reply = copy;
    if (reply_len) *reply_len = c->len;
  }
  *status = st;
  return 0;
}

static int retryable(int rc) {
  return rc == KVF_ECONNREFUSED || rc == KVF_ETIMEDOUT || rc == KVF_ECLOSED || rc == KVF_EIO;
}

static void sleep_ms(int64_t ms) {
  struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0) {
  }
}

int kvf__bootstrap_client_put_route(bootstrap_client *c, const route_reg *reg, int deadline_ms) {
  if (!c || !reg) return KVF_EINVAL;
  char *body = kvf__route_json_encode_put(reg);
  if (!body) return KVF_ENOMEM;
  size_t body_len = strlen(body);
  int64_t deadline = clock_deadline_ms(deadline_ms > 0 ? deadline_ms : 0);
  int64_t backoff = BACKOFF_FIRST_MS;
  int attempts = 0, rc;
  for (;;) {
    int connect_ms = c->connect_timeout_ms, total_ms = c->timeout_ms;
    if (deadline_ms > 0) {
      /* Never let one attempt run past the caller's deadline. */
      int64_t left = (deadline - clock_now_ns()) / 1000000;
      if (left < 1) left = 1;
      if (left < total_ms) total_ms = (int)left;
      if (left < connect_ms) connect_ms = (int)left;
    }
    long status = 0;
    attempts++;
    rc = perform(c, "PUT", "/route", body, body_len, connect_ms, total_ms, &status);
    if (rc == 0) rc = map_status(status);
    if (rc == 0 || !retryable(rc) || deadline_ms <= 0) break;
    int64_t left = (deadline - clock_now_ns()) / 1000000;
    if (left <= 0) break;
    sleep_ms(backoff < left ? backoff : left);
    backoff = backoff * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : backoff * 2;
  }
  if (rc == 0) {
    LOG_INFO(COMP, "registered rank %lld (%s:%lld) with %s after %d attempt(s)", (long long)reg->engine_rank,
             reg->rank_ip, (long long)reg->rank_port, c->addr, attempts);
  } else {
    LOG_WARN(COMP, "registering rank %lld with bootstrap server %s failed after %d attempt(s): %s%s%s",
             (long long)reg->engine_rank, c->addr, attempts, kvf_strerror(rc), c->len ? ": " : "",
             c->len ? c->buf : "");
  }
  free(body);
  return rc;
}

int kvf__bootstrap_client_get_parallel_info(bootstrap_client *c, route_parallel_info *out) {
  if (!c || !out) return KVF_EINVAL;
  long status = 0;
  int rc = perform(c, "GET", "/route?engine_rank=-1&target_dp_group=-1", NULL, 0, c->connect_timeout_ms,
                   c->timeout_ms, &status);
  if (rc == 0) rc = map_status(status);
  if (rc) return rc;
  route_parallel_info p;
  if ((rc = kvf__route_json_parse_parallel_info(c->buf, c->len, &p))) {
    LOG_WARN(COMP, "malformed parallel info from %s", c->addr);
    return rc;
  }
  if (p.world_size < 0) {
    kvf__route_parallel_info_free(&p);
    return KVF_ENOTFOUND;
  }
  *out = p;
  return 0;
}

int kvf__bootstrap_client_get_rank(bootstrap_client *c, int tp_rank, int dp_group, char *ip, size_t iplen,
                                   int *port) {
  if (!c || !ip || !iplen || !port) return KVF_EINVAL;
  char path[96];
  snprintf(path, sizeof path, "/route?engine_rank=%d&target_dp_group=%d", tp_rank, dp_group);
  long status = 0;
  int rc = perform(c, "GET", path, NULL, 0, c->connect_timeout_ms, c->timeout_ms, &status);
  if (rc == 0) rc = map_status(status);
  if (rc) return rc;
  if ((rc = kvf__route_json_parse_rank(c->buf, c->len, ip, iplen, port)))
    LOG_WARN(COMP, "malformed rank lookup reply from %s", c->addr);
  return rc;
}

int kvf__bootstrap_client_health(bootstrap_client *c) {
  if (!c) return KVF_EINVAL;
  long status = 0;
  int rc = perform(c, "GET", "/health", NULL, 0, c->connect_timeout_ms, c->timeout_ms, &status);
  if (rc) return rc;
  return status == 200 ? 0 : KVF_EIO;
}
