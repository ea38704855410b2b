#include "sockets.h"

#include <arpa/inet.h>
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
