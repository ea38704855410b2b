/* Error codes, constants, logging control and version: shared by every part
 * of the API.
 *
 * Threads. Every function declared here may be called from any thread at any
 * time and returns at once (none blocks). */
#ifndef KVFERRY_COMMON_H
#define KVFERRY_COMMON_H

#include <stddef.h>
#include <stdint.h>

/* KVF_API marks what the shared library exports. The library is compiled
 * with hidden visibility, so everything not marked stays internal. */
#if defined(__GNUC__) && __GNUC__ >= 4
#define KVF_API __attribute__((visibility("default")))
#else
#define KVF_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Version of these headers. The library's own is kvf_version(); a program
 * can check at start that the library it loaded is compatible with the
 * headers it was built with: `if (!KVF_VERSION_OK()) exit(1);`. The CMake
 * project version is read from these three lines. */
#define KVF_VERSION_MAJOR 0
#define KVF_VERSION_MINOR 1
#define KVF_VERSION_PATCH 0
#define KVF_VERSION_STR_(x) #x
#define KVF_VERSION_XSTR_(x) KVF_VERSION_STR_(x)
#define KVF_VERSION_STRING             \
  KVF_VERSION_XSTR_(KVF_VERSION_MAJOR) \
  "." KVF_VERSION_XSTR_(KVF_VERSION_MINOR) "." KVF_VERSION_XSTR_(KVF_VERSION_PATCH)
#define KVF_VERSION_NUMBER (KVF_VERSION_MAJOR * 10000 + KVF_VERSION_MINOR * 100 + KVF_VERSION_PATCH)
#define KVF_VERSION_OK() kvf_version_compatible(KVF_VERSION_MAJOR, KVF_VERSION_MINOR)

/* Error codes: 0 is success, failures are negative. One list gives the enum,
 * kvf_strerror and kvf_err_name: X(name, value, text). */
#define KVF_ERROR_LIST(X)                                      \
  X(KVF_OK, 0, "success")                                      \
  X(KVF_EINVAL, -1, "invalid argument or malformed input")     \
  X(KVF_ENOMEM, -2, "out of memory or bound reached")          \
  X(KVF_EIO, -3, "I/O error")                                  \
  X(KVF_ETIMEDOUT, -4, "timed out")                            \
  X(KVF_ECLOSED, -5, "peer closed the connection or died")     \
  X(KVF_EACCES, -6, "authentication refused")                  \
  X(KVF_ERANGE, -7, "address range outside registered memory") \
  X(KVF_ENOTFOUND, -8, "not found")                            \
  X(KVF_EBUSY, -9, "resource busy")                            \
  X(KVF_EPROTO, -10, "protocol error")                         \
  X(KVF_ECONNREFUSED, -11, "connection refused")               \
  X(KVF_ESTATE, -12, "invalid state for this call")            \
  X(KVF_EEXIST, -13, "already exists")                         \
  X(KVF_ETOOBIG, -14, "input exceeds a size bound")            \
  X(KVF_EAGAIN, -15, "not finished yet, try again")

#define KVF_ERROR_ENUM_(name, value, text) name = value,
enum { KVF_ERROR_LIST(KVF_ERROR_ENUM_) };
#undef KVF_ERROR_ENUM_

/* Static, human-readable text for an error code ("unknown error" for a value
 * not in the list); never NULL. Any thread. */
KVF_API const char *kvf_strerror(int err);
/* Static name of an error code ("KVF_EINVAL"; "KVF_E?" when unknown); never
 * NULL. Any thread. */
KVF_API const char *kvf_err_name(int err);

/* Named integer constants of the API (error codes, KVF_POLL_*, KVF_ROLE_*,
 * KVF_SEND_*, KVF_LOG_*, KVF_MAX_CANDIDATES, KVF_ADDR_MAX, KVF_ADDR_HOST_MAX,
 * KVF_VERSION_*, and the sizes
 * KVF_SIZEOF_{ENGINE,MANAGER,BOOTSTRAP_SERVER}_CONFIG and
 * KVF_SIZEOF_SEND_PARAMS), for bindings that cannot read these headers.
 * kvf_const: 0 and *out set, or KVF_ENOTFOUND. kvf_const_at: the i-th name
 * (static) and *out, or NULL past the end, to list them all. Any thread. */
KVF_API int kvf_const(const char *name, int64_t *out);
KVF_API const char *kvf_const_at(size_t i, int64_t *out);

/* Addresses ("host:port"): every call that takes one (bootstrap addresses,
 * engine sessions) accepts a host name or IPv4 literal, or an IPv6 literal in
 * brackets ("[::1]:8998"), with a port in 1..65535; every address the library
 * writes (session ids, peer names in logs and failure reasons) has that form.
 * KVF_ADDR_HOST_MAX: bytes of a host, without brackets. KVF_ADDR_MAX: bytes
 * of the longest address, "[" host "]:65535", without the terminating NUL
 * (a buffer of KVF_ADDR_MAX + 1 holds any of them). */
#define KVF_ADDR_HOST_MAX 255
#define KVF_ADDR_MAX (KVF_ADDR_HOST_MAX + 8)

/* Log levels for kvf_set_log_level(). The default comes from KVFERRY_LOG_LEVEL
 * (error, warn, info, debug) and is warn when unset. Any thread. */
enum { KVF_LOG_ERROR = 0, KVF_LOG_WARN = 1, KVF_LOG_INFO = 2, KVF_LOG_DEBUG = 3 };
KVF_API void kvf_set_log_level(int level);

/* Wake-ups of the library's threads in this process so far: each time one of
 * them returns from a blocking wait (condition variable, poll, a socket read
 * with a tick) with work in hand, for every engine, manager and bootstrap
 * server together (libzmq's own I/O threads are not counted). What idle
 * rooms cost in thread hand-offs: `kvferry bench rooms` reports it per room.
 * A relaxed counter, not a synchronisation point. Any thread. */
KVF_API uint64_t kvf_wakeups(void);

/* The loaded library's version, e.g. "0.1.0". Static string. Any thread. */
KVF_API const char *kvf_version(void);
/* 1 when the loaded library can serve a program built against headers of
 * version major.minor (same major, library minor >= minor), else 0. Use
 * KVF_VERSION_OK(). Any thread. */
KVF_API int kvf_version_compatible(int major, int minor);

#ifdef __cplusplus
}
#endif
#endif
