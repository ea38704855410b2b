#include "sockets.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <linux/sockios.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <netinet/in.h>
#include <stdio.h>
#include <sys/socket.h>
#include <unistd.h>

int kvf_test_silent_listener(char *session, size_t cap) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t sl = sizeof sa;
  if (fd < 0) return -1;
  if (bind(fd, (struct sockaddr *)&sa, sizeof sa) || listen(fd, 4) ||
      getsockname(fd, (struct sockaddr *)&sa, &sl)) {
    close(fd);
    return -1;
  }
  snprintf(session, cap, "127.0.0.1:%u", (unsigned)ntohs(sa.sin_port));
  return fd;
}

long kvf_test_unsent_to(unsigned port) {
  DIR *d = opendir("/proc/self/fd");
  if (!d) return -1;
  long total = -1;
  for (struct dirent *e; (e = readdir(d));) {
    int fd = atoi(e->d_name);
    struct sockaddr_in sa;
    socklen_t sl = sizeof sa;
    int type = 0;
    socklen_t tl = sizeof type;
    if (e->d_name[0] == '.' || fd == dirfd(d) || getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tl) ||
        type != SOCK_STREAM || getpeername(fd, (struct sockaddr *)&sa, &sl) || sa.sin_family != AF_INET ||
        ntohs(sa.sin_port) != port || sa.sin_addr.s_addr != htonl(INADDR_LOOPBACK))
      continue;
    int unsent = 0;
    if (ioctl(fd, SIOCOUTQNSD, &unsent)) continue;
    total = (total < 0 ? 0 : total) + unsent;
  }
  closedir(d);
  return total;
}
