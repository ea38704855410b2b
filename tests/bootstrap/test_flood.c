/* The bootstrap server under connection floods (issue 13, defect 2): raw
 * sockets on 127.0.0.1 that send a request line and nothing more, or trickle
 * a request a byte at a time, must neither make /health time out nor stop
 * PUT/GET /route, and a trickling client is cut at the request deadline
 * although it is never idle. Probes use the project's libcurl client, each
 * on a fresh connection, with a 1 s timeout. */
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include "bootstrap/bootstrap.h"
#include "kvferry.h"

#define HALF_OPEN 300
#define TRICKLING 300
#define PROBE_TIMEOUT_MS 1000 /* /health must answer within this under the flood */

static const char PUT_BODY[] =
    "{\"role\":\"Prefill\",\"world_size\":1,\"dp_size\":1,\"rank_ip\":\"10.0.0.1\",\"rank_port\":39001,"
    "\"engine_rank\":0,\"enable_mla_l1_5_cache\":false,\"kv_item_lens\":[8192],\"kv_unit_lens\":[256],"
    "\"state_item_lens\":[],\"state_unit_lens\":[]}";
static const char TRICKLE[] =
    "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

static kvf_bootstrap_server *start(unsigned max_conns, unsigned idle_s) {
  kvf_bootstrap_server_config cfg;
  kvf_bootstrap_server_config_init(&cfg);
  cfg.host = "127.0.0.1";
  cfg.port = 0;
  cfg.auth_token = "";
  if (max_conns) cfg.max_conns = max_conns;
  if (idle_s) cfg.idle_timeout_s = idle_s;
  kvf_bootstrap_server *srv = NULL;
  assert_int_equal(kvf_bootstrap_server_create(&cfg, &srv), 0);
  return srv;
}

static int raw_connect(uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(0x7f000001)};
  if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a)) {
    if (fd >= 0) close(fd);
    return -1;
  }
  return fd;
}

static int closed_by_peer(int fd) {
  char b[256];
  ssize_t r = recv(fd, b, sizeof b, MSG_DONTWAIT);
  return r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
}

/* One request on a fresh connection; the HTTP status, or a negative error. */
static long request(kvf_bootstrap_server *srv, const char *method, const char *path, const char *body) {
  char addr[32];
  snprintf(addr, sizeof addr, "127.0.0.1:%u", (unsigned)kvf_bootstrap_server_port(srv));
  bootstrap_client_opts o = {.token = "", .connect_timeout_ms = PROBE_TIMEOUT_MS, .timeout_ms = PROBE_TIMEOUT_MS};
  bootstrap_client *c = NULL;
  assert_int_equal(kvf__bootstrap_client_create(addr, &o, &c), 0);
  long status = 0;
  int rc = kvf__bootstrap_client_request(c, method, path, body, body ? strlen(body) : 0, &status, NULL, NULL);
  kvf__bootstrap_client_destroy(c);
  return rc ? rc : status;
}

static uint64_t metric(kvf_bootstrap_server *srv, const char *name) {
  char addr[32], *body = NULL;
  snprintf(addr, sizeof addr, "127.0.0.1:%u", (unsigned)kvf_bootstrap_server_port(srv));
  bootstrap_client_opts o = {.token = "", .connect_timeout_ms = PROBE_TIMEOUT_MS, .timeout_ms = PROBE_TIMEOUT_MS};
  bootstrap_client *c = NULL;
  long status = 0;
  assert_int_equal(kvf__bootstrap_client_create(addr, &o, &c), 0);
  assert_int_equal(kvf__bootstrap_client_request(c, "GET", "/metrics", NULL, 0, &status, &body, NULL), 0);
  kvf__bootstrap_client_destroy(c);
  const char *p = strstr(body, name);
  unsigned long long v = 0;
  if (p) sscanf(p + strlen(name), " %llu", &v);
  free(body);
  return v;
}

/* ---- the flood: half-open connections and tricklers in one thread ---- */

typedef struct flood {
  uint16_t port;
  int half_open, trickling;
  const char *opening; /* what a half-open connection sends; default a request line */
  double period_s, run_s;
  int opened, closed;
  double last_close;
  int fds[HALF_OPEN + TRICKLING];
} flood;

static void *flood_main(void *arg) {
  flood *f = arg;
  int n = f->half_open + f->trickling;
  double t0 = now_s(), next = t0;
  size_t sent = 0;
  for (int i = 0; i < n; i++) {
    f->fds[i] = raw_connect(f->port);
    if (f->fds[i] < 0) continue;
    f->opened++;
    const char *opening = f->opening ? f->opening : "GET /health HTTP/1.1\r\n";
    if (i < f->half_open) send(f->fds[i], opening, strlen(opening), MSG_NOSIGNAL);
  }
  while (now_s() - t0 < f->run_s) {
    int tick = now_s() >= next && sent < sizeof TRICKLE - 1;
    for (int i = 0; i < n; i++) {
      if (f->fds[i] < 0) continue;
      if (tick && i >= f->half_open) send(f->fds[i], TRICKLE + sent, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (closed_by_peer(f->fds[i])) {
        close(f->fds[i]);
        f->fds[i] = -1;
        f->closed++;
        f->last_close = now_s() - t0;
      }
    }
    if (tick) {
      sent++;
      next += f->period_s;
    }
    usleep(20000);
  }
  for (int i = 0; i < n; i++)
    if (f->fds[i] >= 0) close(f->fds[i]);
  return NULL;
}

static void probes_answered(kvf_bootstrap_server *srv, double for_s) {
  double t0 = now_s(), worst = 0;
  int n = 0;
  while (now_s() - t0 < for_s) {
    double t1 = now_s();
    assert_int_equal(request(srv, "GET", "/health", NULL), 200);
    if (now_s() - t1 > worst) worst = now_s() - t1;
    n++;
    usleep(200000);
  }
  printf("/health under the flood: %d probes, slowest %.1f ms (bound %d ms)\n", n, worst * 1e3, PROBE_TIMEOUT_MS);
  assert_true(n >= 3);
  assert_int_equal(request(srv, "PUT", "/route", PUT_BODY), 200);
  assert_int_equal(request(srv, "GET", "/route?engine_rank=0&target_dp_group=0", NULL), 200);
}

/* 300 half-open and 300 trickling connections with the default limits. */
static void flood_does_not_starve_health_or_route(void **state) {
  (void)state;
  kvf_bootstrap_server *srv = start(0, 0);
  flood *f = calloc(1, sizeof *f);
  *f = (flood){.port = kvf_bootstrap_server_port(srv),
               .half_open = HALF_OPEN,
               .trickling = TRICKLING,
               .period_s = 0.5,
               .run_s = 4};
  pthread_t th;
  pthread_create(&th, NULL, flood_main, f);
  usleep(1000000); /* the flood is in */
  probes_answered(srv, 2.0);
  pthread_join(th, NULL);
  assert_int_equal(f->opened, HALF_OPEN + TRICKLING);
  kvf_bootstrap_server_destroy(srv);
  free(f);
}

/* A flood larger than the connection limit: the oldest connections still
 * sending headers are evicted, so the slots never run out. */
static void flood_over_the_limit_evicts_the_oldest(void **state) {
  (void)state;
  kvf_bootstrap_server *srv = start(64, 0);
  flood *f = calloc(1, sizeof *f);
  *f = (flood){.port = kvf_bootstrap_server_port(srv), .half_open = HALF_OPEN, .trickling = 0, .run_s = 3};
  pthread_t th;
  pthread_create(&th, NULL, flood_main, f);
  usleep(1000000);
  probes_answered(srv, 1.0);
  pthread_join(th, NULL);
  assert_true(f->closed >= HALF_OPEN - 64);
  assert_true(metric(srv, "kvferry_bootstrap_errors_total{kind=\"evicted\"}") >= HALF_OPEN - 64);
  kvf_bootstrap_server_destroy(srv);
  free(f);
}

/* The same with requests whose headers are complete but whose body never
 * comes: with no connection left waiting for headers, the oldest request in
 * progress makes room. */
static void stalled_bodies_over_the_limit_evict_the_oldest(void **state) {
  (void)state;
  kvf_bootstrap_server *srv = start(64, 0);
  flood *f = calloc(1, sizeof *f);
  *f = (flood){.port = kvf_bootstrap_server_port(srv),
               .half_open = 200,
               .trickling = 0,
               .run_s = 3,
               .opening = "PUT /route HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n{"};
  pthread_t th;
  pthread_create(&th, NULL, flood_main, f);
  usleep(1000000);
  probes_answered(srv, 1.0);
  pthread_join(th, NULL);
  assert_true(f->closed >= 200 - 64);
  kvf_bootstrap_server_destroy(srv);
  free(f);
}

/* New clients that arrive together while stalled bodies hold the slots:
 * each is still sending its headers when the next one comes, and must not be
 * the one evicted for it (the stalled bodies, older, go first). */
typedef struct burst_client {
  uint16_t port;
  long status;
} burst_client;

static void *burst_client_main(void *arg) {
  burst_client *b = arg;
  char addr[32];
  snprintf(addr, sizeof addr, "127.0.0.1:%u", (unsigned)b->port);
  bootstrap_client_opts o = {.token = "", .connect_timeout_ms = PROBE_TIMEOUT_MS, .timeout_ms = PROBE_TIMEOUT_MS};
  bootstrap_client *c = NULL;
  b->status = -1;
  if (kvf__bootstrap_client_create(addr, &o, &c)) return NULL;
  int rc = kvf__bootstrap_client_request(c, "GET", "/health", NULL, 0, &b->status, NULL, NULL);
  if (rc) b->status = rc;
  kvf__bootstrap_client_destroy(c);
  return NULL;
}

static void burst_of_clients_not_evicted_for_each_other(void **state) {
  (void)state;
  enum { STALLED = 56, BURST = 16 };
  kvf_bootstrap_server *srv = start(64, 0);
  flood *f = calloc(1, sizeof *f);
  *f = (flood){.port = kvf_bootstrap_server_port(srv),
               .half_open = STALLED,
               .trickling = 0,
               .run_s = 5.5,
               .opening = "PUT /route HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n{"};
  pthread_t th, cl[BURST];
  pthread_create(&th, NULL, flood_main, f);
  usleep(2500000); /* the stalled bodies are in, older than the grace period (2 s) */
  burst_client b[BURST];
  for (int i = 0; i < BURST; i++) {
    b[i] = (burst_client){.port = kvf_bootstrap_server_port(srv)};
    pthread_create(&cl[i], NULL, burst_client_main, &b[i]);
  }
  int ok = 0;
  for (int i = 0; i < BURST; i++) {
    pthread_join(cl[i], NULL);
    ok += b[i].status == 200;
  }
  pthread_join(th, NULL);
  printf("burst of %d clients over %d stalled bodies (limit 64): %d answered\n", BURST, STALLED, ok);
  assert_int_equal(ok, BURST);
  kvf_bootstrap_server_destroy(srv);
  free(f);
}

/* MHD's own timeout is an idle timeout: a byte every 0.3 s would hold the
 * connection forever. The request deadline (here idle_timeout_s = 2) cuts
 * it however busy it keeps. */
static void trickling_client_cut_at_the_deadline(void **state) {
  (void)state;
  kvf_bootstrap_server *srv = start(0, 2);
  flood *f = calloc(1, sizeof *f);
  *f = (flood){.port = kvf_bootstrap_server_port(srv),
               .half_open = 5,
               .trickling = 5,
               .period_s = 0.3,
               .run_s = 4.5};
  pthread_t th;
  pthread_create(&th, NULL, flood_main, f);
  pthread_join(th, NULL);
  printf("trickling HTTP clients: %d of 10 cut, the last after %.2f s (deadline 2 s)\n", f->closed, f->last_close);
  assert_int_equal(f->closed, 10);
  assert_true(f->last_close > 1.5 && f->last_close < 3.5);
  /* The 5 silent ones may fall to MHD's idle timeout (also 2 s) first; the
   * 5 tricklers only to the request deadline. */
  assert_true(metric(srv, "kvferry_bootstrap_errors_total{kind=\"slow\"}") >= 5);
  kvf_bootstrap_server_destroy(srv);
  free(f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(flood_does_not_starve_health_or_route),
      cmocka_unit_test(flood_over_the_limit_evicts_the_oldest),
      cmocka_unit_test(stalled_bodies_over_the_limit_evict_the_oldest),
      cmocka_unit_test(burst_of_clients_not_evicted_for_each_other),
      cmocka_unit_test(trickling_client_cut_at_the_deadline),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
