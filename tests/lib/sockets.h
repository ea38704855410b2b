/* Sockets the tests stand in for peers with. Linked into every test
 * program (tests/CMakeLists.txt, kvf_test_case). */
#ifndef KVF_TESTS_LIB_SOCKETS_H
#define KVF_TESTS_LIB_SOCKETS_H

#include <stddef.h>

/* A TCP socket on 127.0.0.1 that listens and never accepts: a peer whose
 * host answers the connect (the kernel completes it) and nothing more, as a
 * stopped process. Writes its "127.0.0.1:port" to session; returns the
 * socket (closing it resets the connections waiting in its backlog), or -1. */
int kvf_test_silent_listener(char *session, size_t cap);

/* Bytes this process has queued but not yet sent on its TCP connections to
 * 127.0.0.1:port (SIOCOUTQNSD, summed over every such socket), or -1 when
 * it has none. */
long kvf_test_unsent_to(unsigned port);

#endif
