/* The API's named integer constants as a table (kvf_const), so bindings
 * take them from the library instead of copying the headers by hand. */
#include <string.h>

#include "kvferry.h"

typedef struct kvf_const_entry {
  const char *name;
  int64_t value;
} kvf_const_entry;

#define KVF_CONST_(name) {#name, (int64_t)(name)},
#define KVF_ERROR_CONST_(name, value, text) {#name, (int64_t)(value)},

static const kvf_const_entry consts[] = {
    KVF_ERROR_LIST(KVF_ERROR_CONST_) KVF_CONST_(KVF_POLL_FAILED) KVF_CONST_(KVF_POLL_BOOTSTRAPPING)
        KVF_CONST_(KVF_POLL_BOOTSTRAPPED) KVF_CONST_(KVF_POLL_WAITING_FOR_INPUT) KVF_CONST_(KVF_POLL_TRANSFERRING)
            KVF_CONST_(KVF_POLL_SUCCESS) KVF_CONST_(KVF_ROLE_PREFILL) KVF_CONST_(KVF_ROLE_DECODE)
                KVF_CONST_(KVF_SEND_LAST) KVF_CONST_(KVF_SEND_TOKEN_LATER) KVF_CONST_(KVF_SEND_LAYERS)
                    KVF_CONST_(KVF_MAX_CANDIDATES) KVF_CONST_(KVF_ADDR_MAX) KVF_CONST_(KVF_ADDR_HOST_MAX)
                        KVF_CONST_(KVF_LOG_ERROR) KVF_CONST_(KVF_LOG_WARN) KVF_CONST_(KVF_LOG_INFO)
                            KVF_CONST_(KVF_LOG_DEBUG) KVF_CONST_(KVF_VERSION_MAJOR) KVF_CONST_(KVF_VERSION_MINOR)
                                KVF_CONST_(KVF_VERSION_PATCH){"KVF_SIZEOF_ENGINE_CONFIG",
                                                              (int64_t)sizeof(kvf_engine_config)},
    {"KVF_SIZEOF_MANAGER_CONFIG", (int64_t)sizeof(kvf_manager_config)},
    {"KVF_SIZEOF_BOOTSTRAP_SERVER_CONFIG", (int64_t)sizeof(kvf_bootstrap_server_config)},
    {"KVF_SIZEOF_SEND_PARAMS", (int64_t)sizeof(kvf_send_params)},
};

#define NCONSTS (sizeof consts / sizeof consts[0])

int kvf_const(const char *name, int64_t *out) {
  if (!name || !out) return KVF_EINVAL;
  for (size_t i = 0; i < NCONSTS; i++)
    if (!strcmp(consts[i].name, name)) {
      *out = consts[i].value;
      return 0;
    }
  return KVF_ENOTFOUND;
}

const char *kvf_const_at(size_t i, int64_t *out) {
  if (i >= NCONSTS) return NULL;
  if (out) *out = consts[i].value;
  return consts[i].name;
}
