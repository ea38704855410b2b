/* Decode start and stop: the caches, planner inputs converted once, and
 * the heartbeat thread. */
#include "kv/decode/decode_int.h"

static void free_state(struct decode_state *ds) {
  if (!ds) return;
  map_iter it;
  void *v;
  kvf__map_iter_init(&it);
  while (kvf__smap_next(&ds->infos, &it, NULL, &v)) kvf__dec_addr_entry_free(v);
  kvf__smap_free(&ds->infos);
  kvf__map_iter_init(&it);
  while (kvf__smap_next(&ds->down, &it, NULL, &v)) free(v);
  kvf__smap_free(&ds->down);
  kvf__map_iter_init(&it);
  while (kvf__smap_next(&ds->pools, &it, NULL, &v)) kvf__dec_pool_unref(v);
  kvf__smap_free(&ds->pools);
  kvf__map_iter_init(&it);
  while (kvf__smap_next(&ds->hb_peers, &it, NULL, &v)) kvf__dec_hb_peer_free(v);
  kvf__smap_free(&ds->hb_peers);
  while (ds->spare) {
    kvf_receiver *r = ds->spare;
    ds->spare = r->next_spare;
    kvf__dec_receiver_free(r);
  }
  free(ds->d_kv_item), free(ds->d_kv_unit), free(ds->d_state_item), free(ds->d_state_unit);
  kvf__dec_bound_bufs_free(ds);
  pthread_mutex_destroy(&ds->lock);
  pthread_mutex_destroy(&ds->hb_lock);
  pthread_cond_destroy(&ds->hb_cond);
  free(ds);
}

int kvf__decode_start(kvf_manager *m) {
  struct decode_state *ds = calloc(1, sizeof *ds);
  if (!ds) return KVF_ENOMEM;
  int rc = KVF_ENOMEM;
  pthread_mutex_init(&ds->lock, NULL);
  pthread_mutex_init(&ds->hb_lock, NULL);
  clock_cond_init(&ds->hb_cond);
  if (smap_init(&ds->infos) || smap_init(&ds->down) || smap_init(&ds->pools) || smap_init(&ds->hb_peers))
    goto fail;
  const manager_buffers *b = &m->bufs;
  ds->d_kv_item = kvf__dec_to_i64(b->kv_item_lens, b->n_kv);
  ds->d_kv_unit = kvf__dec_to_i64(b->kv_unit_lens, b->n_kv);
  ds->d_state_item = kvf__dec_to_i64(b->state_item_lens, b->n_state);
  ds->d_state_unit = kvf__dec_to_i64(b->state_unit_lens, b->n_state);
  if (!ds->d_kv_item || !ds->d_kv_unit || !ds->d_state_item || !ds->d_state_unit) goto fail;
  if (kvf__dec_bound_bufs_build(ds, b)) goto fail;
  ds->layout = b->kv_layout;
  m->decode = ds;
  /* A shared engine has one trailer callback: the first decode manager gets it. */
  ds->fast = m->cfg.fast_completion && !kvf__engine_on_trailer(m->engine, kvf__dec_on_trailer, m);
  ds->refusals = !kvf__engine_on_refusal(m->engine, kvf__integ_on_refused, m);
  ds->landed = kvf__integ_hashes_landing(m) && !kvf__engine_on_landed(m->engine, kvf__integ_on_landed, m);
  if (pthread_create(&ds->hb, NULL, kvf__dec_heartbeat_main, m)) {
    if (ds->fast) kvf__engine_off_trailer(m->engine, m);
    if (ds->refusals) kvf__engine_off_refusal(m->engine, m);
    if (ds->landed) kvf__engine_off_landed(m->engine, m);
    m->decode = NULL;
    goto fail;
  }
  ds->hb_started = 1;
  return 0;
fail:
  free_state(ds);
  return rc;
}

void kvf__decode_stop(kvf_manager *m) {
  struct decode_state *ds = m->decode;
  if (!ds) return;
  if (ds->fast) kvf__engine_off_trailer(m->engine, m); /* returns once no trailer is being handled */
  if (ds->refusals) kvf__engine_off_refusal(m->engine, m);
  if (ds->landed) kvf__engine_off_landed(m->engine, m); /* returns once no landing is being hashed */
  if (ds->hb_started) {
    pthread_mutex_lock(&ds->hb_lock);
    ds->hb_stop = 1;
    pthread_cond_signal(&ds->hb_cond);
    pthread_mutex_unlock(&ds->hb_lock);
    pthread_join(ds->hb, NULL);
  }
  m->decode = NULL;
  free_state(ds);
}

const manager_role_ops kvf__decode_role = {
    .name = "decode",
    .start = kvf__decode_start,
    .stop = kvf__decode_stop,
    .on_message = kvf__decode_on_message,
    .trace_of = kvf__dec_trace_of,
};
