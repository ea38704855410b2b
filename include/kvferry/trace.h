/*
 * Room traces (issue 25): for every room a manager handles, the monotonic
 * time of each step this side can observe, the bytes and descriptors moved,
 * the transport and mode per peer, retries, the final status and the
 * failure reason. A manager keeps the records of its last
 * kvf_manager_config.trace_rooms finished rooms in a ring allocated once
 * (no allocation per room); with KVFERRY_TRACE=FILE it also appends one
 * JSON line per finished room to FILE (docs/TRACE.md has the schema).
 *
 * Clocks. Step times are CLOCK_MONOTONIC nanoseconds of the process that
 * recorded them. Within one record, differences are durations on one clock.
 * The prefill's and the decode's records of one room are joined by room id;
 * compare durations of each side, never a time of one host with a time of
 * another (their monotonic clocks are unrelated; t0_unix_ns is for humans).
 *
 * Threads. Every call here may be made from any thread; the getters copy
 * into caller-owned memory and never block on the network.
 */
#ifndef KVFERRY_TRACE_H
#define KVFERRY_TRACE_H

#include <stddef.h>
#include <stdint.h>

#include "kvferry/common.h"
#include "kvferry/kv.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The steps, in the order a room normally reaches them on its side. A
 * decode records created .. completion_seen and final; a prefill
 * m2_received .. completion_sent and final. docs/TRACE.md says which event
 * each one is on each path, and which steps a path cannot observe (those
 * stay 0: never invented). */
typedef enum kvf_trace_step {
  /* decode */
  KVF_TRACE_CREATED = 0,         /* kvf_receiver_create entered */
  KVF_TRACE_DISCOVERY_DONE = 1,  /* the prefill ranks' addresses are known (cache hit or HTTP lookups) */
  KVF_TRACE_M1_SENT = 2,         /* M1 handed to ZeroMQ (only when this room registered: a cache miss) */
  KVF_TRACE_M2_SENT = 3,         /* the first M2 handed to ZeroMQ (the last kvf_receiver_init) */
  KVF_TRACE_FIRST_BYTE = 4,      /* the room's first chunk began landing here (TCP, or a UCX read) */
  KVF_TRACE_LAST_BYTE = 5,       /* the room's last chunk has landed here */
  KVF_TRACE_COMPLETION_SEEN = 6, /* the prefill's verdict arrived (M3 or completion trailer) */
  /* prefill */
  KVF_TRACE_M2_RECEIVED = 7,           /* the first M2 of the room arrived */
  KVF_TRACE_SENDER_CREATED = 8,        /* kvf_sender_create */
  KVF_TRACE_FIRST_CHUNK_SUBMITTED = 9, /* the first kvf_sender_send */
  KVF_TRACE_LAST_CHUNK_SUBMITTED = 10, /* the kvf_sender_send of the last chunk */
  KVF_TRACE_FIRST_BYTE_SENT = 11,      /* the room's first engine write was submitted */
  KVF_TRACE_LAST_BYTE_DONE = 12,       /* the engine confirmed the room's last write landed */
  KVF_TRACE_COMPLETION_SENT = 13,      /* the M3s were handed to ZeroMQ (or the outbox) */
  /* both */
  KVF_TRACE_FINAL = 14, /* the first poll that returned Success or Failed */
  KVF_TRACE_NSTEPS = 15
} kvf_trace_step;

#define KVF_TRACE_MAX_PEERS 4    /* peers kept per record (the first ones of the room) */
#define KVF_TRACE_REASON_MAX 160 /* bytes of the failure reason kept, NUL included */

typedef struct kvf_trace_peer {
  char peer[KVF_ADDR_MAX +
            1];      /* decode: the prefill rank's control address; prefill: the decode's engine session */
  char transport[8]; /* "tcp", "ucx", or "" when not known */
  char mode[8];      /* "tcp", "read" (the decode pulls over UCX), "write" (one-sided UCX puts), or "" */
} kvf_trace_peer;

/* One room as one side saw it. Fixed size: copied by value. */
typedef struct kvf_room_trace {
  int64_t room;
  int side;                       /* KVF_ROLE_DECODE or KVF_ROLE_PREFILL */
  int rank;                       /* this manager's TP rank */
  int status;                     /* a kvf_poll_status: final when `finished`, else the current one */
  int finished;                   /* 1: in the ring (the room was cleared); 0: a live room's record so far */
  int64_t t_ns[KVF_TRACE_NSTEPS]; /* CLOCK_MONOTONIC ns of each step, 0 = not reached */
  int64_t t0_unix_ns;             /* wall clock of the first step, for humans only */
  uint64_t bytes;   /* decode: bytes asked for (pages x page bytes); prefill: bytes confirmed written */
  uint64_t descs;   /* prefill: engine write descriptors submitted; decode: pages asked for */
  uint64_t chunks;  /* prefill: kvf_sender_send chunks; decode: chunks that landed here (TCP/UCX read) */
  uint64_t retries; /* decode: repeated kvf_receiver_init; prefill: repeated M2s from one session */
  uint32_t npeers;
  kvf_trace_peer peers[KVF_TRACE_MAX_PEERS];
  char engine[KVF_ADDR_MAX + 1];     /* this manager's engine session "host:port" */
  char reason[KVF_TRACE_REASON_MAX]; /* the failure reason, "" if none */
} kvf_room_trace;

/* The step's name as in the JSON schema ("created", "m2_received", ...),
 * or NULL for a value out of range. Static string. */
KVF_API const char *kvf_trace_step_name(int step);

/* The record of `room` on manager m: the live room's record so far
 * (finished 0), else the newest finished one in the ring. 0,
 * KVF_ENOTFOUND (never traced, or no longer in the ring), KVF_EINVAL. */
KVF_API int kvf_manager_trace_get(kvf_manager *m, int64_t room, kvf_room_trace *out);
/* Walk the ring: copy the newest min(cap, kept) finished records into
 * out[0..n), oldest first, and return n. Any thread. */
KVF_API size_t kvf_manager_trace_copy(kvf_manager *m, kvf_room_trace *out, size_t cap);
/* Turn recording on (1) or off (0) for rooms created from now on (a room
 * keeps the setting it started with). KVF_ESTATE when the manager was
 * created with trace_rooms 0 (no ring). Any thread. */
KVF_API int kvf_manager_trace_enable(kvf_manager *m, int on);

/* The record as one line of the KVFERRY_TRACE schema (docs/TRACE.md),
 * with a final '\n': its length, or 0 when it does not fit in cap. */
KVF_API size_t kvf_trace_format_json(const kvf_room_trace *t, char *buf, size_t cap);
/* The reverse, for tools that read a KVFERRY_TRACE file: one line into
 * *out (finished 1; unknown step names are skipped, t_ns are the line's
 * offsets from the first step). 0 or KVF_EINVAL (not a v1 record). */
KVF_API int kvf_trace_parse_json(const char *line, kvf_room_trace *out);

#ifdef __cplusplus
}
#endif
#endif
