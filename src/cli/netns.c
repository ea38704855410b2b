/* Network namespaces joined by a bridge, for `kvferry demo --cluster
 * --netns` (see netns.h). Every step is an `ip` command, so what is made is
 * exactly what an operator would type, and what a failure prints is ip's own
 * message. */
#include "netns.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The `ip` program: children are started with execv, which takes a path. */
static char ip_path[256];

static int find_ip(void) {
  const char *path = getenv("PATH");
  char dirs[1024];
  snprintf(dirs, sizeof dirs, "%s:/usr/sbin:/sbin:/usr/bin:/bin", path ? path : "");
  for (char *save = NULL, *d = strtok_r(dirs, ":", &save); d; d = strtok_r(NULL, ":", &save)) {
    snprintf(ip_path, sizeof ip_path, "%s/ip", d);
    if (*d && access(ip_path, X_OK) == 0) return 0;
  }
  *ip_path = 0;
  return -1;
}

/* Run `ip ARGS` (built from fmt; only names made here, no shell quoting
 * needed); its output (stderr too) goes into out. The exit status. */
static int ip(char *out, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int ip(char *out, size_t cap, const char *fmt, ...) {
  char cmd[1024], args[400];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(args, sizeof args, fmt, ap);
  va_end(ap);
  snprintf(cmd, sizeof cmd, "%s %s 2>&1", ip_path, args);
  if (out && cap) *out = 0;
  FILE *f = popen(cmd, "r");
  if (!f) return -1;
  size_t n = out && cap ? fread(out, 1, cap - 1, f) : 0;
  if (out && cap) {
    out[n] = 0;
    for (char *p = out + strlen(out); p > out && (p[-1] == '\n' || p[-1] == ' ');) *--p = 0;
  }
  char sink[256];
  while (fread(sink, 1, sizeof sink, f) > 0) {
  }
  int st = pclose(f);
  return st;
}

void cl_netns_prefix(const cl_netns *c, int i, char *pre[5]) {
  static char netns[] = "netns", exec[] = "exec";
  pre[0] = ip_path, pre[1] = netns, pre[2] = exec, pre[3] = (char *)c->ns[i], pre[4] = NULL;
}

int cl_netns_up(cl_netns *c, int n, char *err, size_t cap) {
  char out[300];
  memset(c, 0, sizeof *c);
  if (n < 1 || n > CL_NETNS_MAX) {
    snprintf(err, cap, "--netns: 1..%d instances", CL_NETNS_MAX);
    return -1;
  }
  if (geteuid() != 0) {
    snprintf(err, cap, "--netns needs root (network namespaces, veth links and a bridge are made with `ip`)");
    return 1;
  }
  if (find_ip()) {
    snprintf(err, cap, "--netns needs iproute2 (`ip` not found in $PATH, /usr/sbin or /sbin)");
    return 1;
  }
  c->tag = (unsigned)getpid() & 0xfffffu;
  const unsigned subnet = (unsigned)getpid() % 250 + 1; /* 10.214.<subnet>.<instance + 1> */
  snprintf(c->bridge_name, sizeof c->bridge_name, "kvf%05xbr", c->tag);
  if (ip(out, sizeof out, "link add %s type bridge", c->bridge_name)) {
    snprintf(err, cap, "--netns: cannot make a bridge (ip link add %s type bridge: %s)", c->bridge_name, out);
    return 1;
  }
  c->bridge = 1;
  if (ip(out, sizeof out, "link set %s up", c->bridge_name)) goto fail;
  for (int i = 0; i < n; i++) {
    char a[24], b[24]; /* at most 15 bytes: i < CL_NETNS_MAX */
    snprintf(c->ns[i], sizeof c->ns[i], "kvf%05x-%d", c->tag, i);
    snprintf(c->host[i], sizeof c->host[i], "10.214.%u.%d", subnet, i + 1);
    snprintf(a, sizeof a, "kvf%05xv%dr", c->tag, i);
    snprintf(b, sizeof b, "kvf%05xv%dn", c->tag, i);
    if (ip(out, sizeof out, "netns add %s", c->ns[i])) {
      snprintf(err, cap, "--netns: cannot make a network namespace (ip netns add %s: %s)", c->ns[i], out);
      cl_netns_down(c);
      return i == 0 ? 1 : -1;
    }
    c->n = i + 1;
    if (ip(out, sizeof out, "link add %s type veth peer name %s", a, b) ||
        ip(out, sizeof out, "link set %s netns %s", b, c->ns[i]) ||
        ip(out, sizeof out, "link set %s master %s", a, c->bridge_name) ||
        ip(out, sizeof out, "link set %s up", a) ||
        ip(out, sizeof out, "-n %s addr add %s/24 dev %s", c->ns[i], c->host[i], b) ||
        ip(out, sizeof out, "-n %s link set %s up", c->ns[i], b) ||
        ip(out, sizeof out, "-n %s link set lo up", c->ns[i]))
      goto fail;
  }
  return 0;
fail:
  snprintf(err, cap, "--netns: setting up the namespaces failed: %s", out);
  cl_netns_down(c);
  return -1;
}

void cl_netns_down(cl_netns *c) {
  /* Deleting a namespace deletes its veth end, and so the pair. */
  for (int i = c->n - 1; i >= 0; i--) {
    char a[24];
    ip(NULL, 0, "netns del %s", c->ns[i]);
    snprintf(a, sizeof a, "kvf%05xv%dr", c->tag, i);
    ip(NULL, 0, "link del %s", a); /* gone already unless the move into the namespace failed */
  }
  c->n = 0;
  if (c->bridge) ip(NULL, 0, "link del %s", c->bridge_name);
  c->bridge = 0;
}
