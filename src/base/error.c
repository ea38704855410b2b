/* Error code texts and names (from the one list in kvferry/common.h) and the
 * library version. */
#include "kvferry/common.h"

const char *kvf_strerror(int err) {
  switch (err) {
#define KVF_ERROR_TEXT_(name, value, text) \
  case value: return text;
    KVF_ERROR_LIST(KVF_ERROR_TEXT_)
#undef KVF_ERROR_TEXT_
    default: return "unknown error";
  }
}

const char *kvf_err_name(int err) {
  switch (err) {
#define KVF_ERROR_NAME_(name, value, text) \
  case value: return #name;
    KVF_ERROR_LIST(KVF_ERROR_NAME_)
#undef KVF_ERROR_NAME_
    default: return "KVF_E?";
  }
}

const char *kvf_version(void) { return KVF_VERSION_STRING; }

int kvf_version_compatible(int major, int minor) {
  return major == KVF_VERSION_MAJOR && minor <= KVF_VERSION_MINOR;
}
