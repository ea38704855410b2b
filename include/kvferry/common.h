/* Error codes, logging control and version: shared by every part of the API. */
#ifndef KVFERRY_COMMON_H
#define KVFERRY_COMMON_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVF_VERSION_STRING "0.1.0"

/* Error codes: 0 is success, failures are these negative values. */
enum {
  KVF_OK = 0,
  KVF_EINVAL = -1,     /* bad argument or malformed input */
  KVF_ENOMEM = -2,     /* allocation failed or a bound was reached */
  KVF_EIO = -3,        /* socket or system call failed */
  KVF_ETIMEDOUT = -4,  /* a deadline passed */
  KVF_ECLOSED = -5,    /* the peer closed or died */
  KVF_EACCES = -6,     /* authentication refused */
  KVF_ERANGE = -7,     /* an address range is outside registered memory */
  KVF_ENOTFOUND = -8,  /* unknown session, room, rank or region */
  KVF_EBUSY = -9,      /* resource in use (e.g. unregister during a write) */
  KVF_EPROTO = -10,    /* a peer broke the protocol */
  KVF_ECONNREFUSED = -11, /* could not connect to the peer */
  KVF_ESTATE = -12,    /* call not valid in the object's current state */
  KVF_EEXIST = -13,    /* already exists (e.g. overlapping registration) */
  KVF_ETOOBIG = -14,   /* input exceeds a configured size bound */
};

/* Static, human-readable text for an error code; never NULL. Any thread. */
const char *kvf_strerror(int err);

/* Log levels for kvf_set_log_level(). The default comes from KVFERRY_LOG_LEVEL
 * (error, warn, info, debug) and is warn when unset. Any thread. */
enum { KVF_LOG_ERROR = 0, KVF_LOG_WARN = 1, KVF_LOG_INFO = 2, KVF_LOG_DEBUG = 3 };
void kvf_set_log_level(int level);

/* Library version, e.g. "0.1.0". Static string. */
const char *kvf_version(void);

#ifdef __cplusplus
}
#endif
#endif
