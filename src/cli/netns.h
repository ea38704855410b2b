/* Network namespaces for `kvferry demo --cluster --netns`: one namespace per
 * instance, each joined by a veth pair to a bridge in the root namespace, as
 * hosts on one switch. Addresses come from 10.214.0.0/16 and exist only
 * inside the namespaces made here; names carry this process's id so that
 * concurrent runs do not collide. Needs root and iproute2 (`ip`). */
#ifndef KVF_CLI_NETNS_H
#define KVF_CLI_NETNS_H

#include <stddef.h>

#define CL_NETNS_MAX 128

typedef struct cl_netns {
  unsigned tag;
  int n;      /* namespaces made (deleted by cl_netns_down) */
  int bridge; /* 1 once the bridge exists */
  char bridge_name[16];
  char ns[CL_NETNS_MAX][24];
  char host[CL_NETNS_MAX][20]; /* the namespace's address */
} cl_netns;

/* Make n namespaces with addresses. 0; 1 when namespaces cannot be made here
 * (not root, no `ip`, `ip netns add` refused: why in err); -1 on another
 * failure (why in err). Whatever was made is deleted again on failure. */
int cl_netns_up(cl_netns *c, int n, char *err, size_t cap);
/* Delete everything cl_netns_up made (idempotent). */
void cl_netns_down(cl_netns *c);
/* The command prefix that runs a program in namespace i: {"ip", "netns",
 * "exec", NAME, NULL}, pointing into c and the static "ip" strings. */
void cl_netns_prefix(const cl_netns *c, int i, char *pre[5]);

#endif
