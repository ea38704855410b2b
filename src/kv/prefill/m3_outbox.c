/* Deferred M3s: the status messages that only duplicate a completion which
 * already rode the data (docs/WIRE-EXTENSIONS.md, "completion rides the
 * data"), sent in batches instead of one at a time.
 *
 * Between two kvferry peers the decode takes a room's Success from the
 * engine trailer behind its last bytes; the M3 that still goes out for
 * compatibility changes nothing there. Sent one by one, as acknowledgements
 * come in, each costs a wake-up of this process's ZeroMQ I/O thread, the
 * decode's and the decode's listener. Held here and sent PF_M3_BATCH at a
 * time (each still its own ZeroMQ message, byte for byte the same), those
 * wake-ups are shared by the batch. An M3 waits at most about
 * PF_M3_DEFER_MS: the first M3 of a batch wakes the listener
 * (kvf__control_wake), which then waits no longer than until the batch is
 * due and sends it (kvf__pf_m3_tick); the manager's stop sends the rest. Only M3 Success
 * for a destination whose trailer the engine delivered is deferred; every
 * other M3 (Failed, M3-only peers, tokenspeed decodes) goes out at once.
 *
 * Locks: m3_lock guards the queue (m3q, nm3, m3_since_ns); m3_send_lock is
 * held by the one thread sending a detached batch (m3out), taken before
 * m3_lock. Neither is taken with ps->lock held, nor ps->lock under them. */
#include "kv/prefill/prefill_int.h"

int kvf__pf_m3_init(prefill_state *ps) {
  pthread_mutex_init(&ps->m3_lock, NULL);
  pthread_mutex_init(&ps->m3_send_lock, NULL);
  ps->m3q = calloc(PF_M3_BATCH, sizeof *ps->m3q);
  ps->m3out = calloc(PF_M3_BATCH, sizeof *ps->m3out);
  return ps->m3q && ps->m3out ? 0 : KVF_ENOMEM;
}

void kvf__pf_m3_free(prefill_state *ps) {
  free(ps->m3q), free(ps->m3out);
  ps->m3q = ps->m3out = NULL;
  pthread_mutex_destroy(&ps->m3_lock);
  pthread_mutex_destroy(&ps->m3_send_lock);
}

/* Send the queue when `all`, when it is full, or when its oldest M3 is due. */
void kvf__pf_m3_flush(prefill_state *ps, int all) {
  pthread_mutex_lock(&ps->m3_send_lock);
  pthread_mutex_lock(&ps->m3_lock);
  size_t n = 0;
  if (ps->nm3 &&
      (all || ps->nm3 == PF_M3_BATCH || clock_now_ns() - ps->m3_since_ns >= (int64_t)PF_M3_DEFER_MS * 1000000)) {
    pf_m3 *q = ps->m3q;
    ps->m3q = ps->m3out, ps->m3out = q;
    n = ps->nm3;
    ps->nm3 = 0;
  }
  pthread_mutex_unlock(&ps->m3_lock);
  for (size_t i = 0; i < n; i++) {
    const pf_m3 *x = &ps->m3out[i];
    pf_m3_msg msg = {.room = x->room,
                     .status = ROOM_SUCCESS,
                     .token = x->token,
                     .cands = x->cands,
                     .ncand = x->ncand};
    kvf__pf_send_m3(ps->m, x->d.host, x->d.port, x->d.epoch, &msg);
  }
  pthread_mutex_unlock(&ps->m3_send_lock);
}

/* Queue an M3 Success: 1 when queued (it goes out within about
 * PF_M3_DEFER_MS), 0 when the caller must send it now. */
static int m3_defer(prefill_state *ps, const char *host, uint16_t port, uint64_t epoch, const pf_m3_msg *msg) {
  if (msg->status != ROOM_SUCCESS || msg->ncand > KVF_MAX_CANDIDATES || strlen(host) >= sizeof ps->m3q[0].d.host)
    return 0;
  pthread_mutex_lock(&ps->m3_lock);
  size_t k = ps->nm3;
  if (k == PF_M3_BATCH) { /* a batch is waiting to be sent: this one goes now */
    pthread_mutex_unlock(&ps->m3_lock);
    return 0;
  }
  pf_m3 *x = &ps->m3q[k];
  kvf__str_copy(x->d.host, sizeof x->d.host, host);
  x->d.port = port;
  x->d.epoch = epoch;
  x->room = msg->room;
  x->token = msg->token;
  x->ncand = msg->cands ? msg->ncand : 0;
  if (x->ncand) memcpy(x->cands, msg->cands, x->ncand * sizeof *msg->cands);
  if (k == 0) ps->m3_since_ns = clock_now_ns();
  ps->nm3 = k + 1;
  pthread_mutex_unlock(&ps->m3_lock);
  if (k + 1 == PF_M3_BATCH) kvf__pf_m3_flush(ps, 0);
  else if (k == 0)
    kvf__control_wake(ps->m); /* the listener may be in a longer wait: it sets its next one by the tick */
  return 1;
}

int kvf__pf_m3_tick(kvf_manager *m) {
  prefill_state *ps = m->prefill;
  if (!ps) return -1;
  pthread_mutex_lock(&ps->m3_lock);
  size_t n = ps->nm3;
  int64_t left = (int64_t)PF_M3_DEFER_MS * 1000000 - (clock_now_ns() - ps->m3_since_ns);
  pthread_mutex_unlock(&ps->m3_lock);
  if (!n) return -1;
  if (left <= 0) { /* due: the oldest has waited PF_M3_DEFER_MS */
    kvf__pf_m3_flush(ps, 0);
    return -1;
  }
  return (int)((left + 999999) / 1000000); /* wake when it is due */
}

void kvf__pf_m3_to(prefill_state *ps, const wire_m2 *y, int carried, const pf_m3_msg *msg) {
  if (carried && m3_defer(ps, y->endpoint, y->dst_port, y->fence_epoch, msg)) return;
  kvf__pf_send_m3(ps->m, y->endpoint, y->dst_port, y->fence_epoch, msg);
}
