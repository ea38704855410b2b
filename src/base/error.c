/* Error code texts and the library version. */
#include "kvferry/common.h"

const char *kvf_strerror(int err) {
  switch (err) {
    case KVF_OK: return "success";
    case KVF_EINVAL: return "invalid argument or malformed input";
    case KVF_ENOMEM: return "out of memory or bound reached";
    case KVF_EIO: return "I/O error";
    case KVF_ETIMEDOUT: return "timed out";
    case KVF_ECLOSED: return "peer closed the connection or died";
    case KVF_EACCES: return "authentication refused";
    case KVF_ERANGE: return "address range outside registered memory";
    case KVF_ENOTFOUND: return "not found";
    case KVF_EBUSY: return "resource busy";
    case KVF_EPROTO: return "protocol error";
    case KVF_ECONNREFUSED: return "connection refused";
    case KVF_ESTATE: return "invalid state for this call";
    case KVF_EEXIST: return "already exists";
    case KVF_ETOOBIG: return "input exceeds a size bound";
    default: return "unknown error";
  }
}

const char *kvf_version(void) { return KVF_VERSION_STRING; }
