/* One router shared by many pthreads: routing (and completing), metric updates, reloads, KV
 * events and stats at the same time; one decision read by every thread at once; and the last
 * error, which is per thread.
 *
 * Usage: threads [ROUTES_PER_THREAD] */
#include <pthread.h>
#include <stdatomic.h>

#include "common.h"

#define THREADS 8
#define ENDPOINTS 16

static kvroute_router *g_router;
static int g_routes = 200;
static atomic_int g_errors;
static atomic_int g_done_routers;
static const kvroute_decision *g_shared;
static atomic_int g_batches;

/* A KV-event batch (vLLM map encoding) storing 2 blocks of 16 tokens (as in errors.c). */
static const char *EVENT_HEX =
    "93cb3ff000000000000091"
    "88a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573920102b1706172656e745f626c6f636b5f68617368"
    "c0a9746f6b656e5f696473dc0020000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1faa626c6f63"
    "6b5f73697a6510a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c000";
static char g_shared_endpoint[64];

static void endpoint_id(int i, char *buf, size_t n) { snprintf(buf, n, "10.0.%d.%d:8000", i / 256, i % 256); }

static void fail(const char *what, kvroute_result r) {
    atomic_fetch_add(&g_errors, 1);
    fprintf(stderr, "%s: %s (%s)\n", what, code_name(r), last_error());
}

static void *router_thread(void *arg) {
    int t = (int)(intptr_t)arg;
    char body[512], session[32], id[128], ep[64];
    for (int i = 0; i < g_routes; i++) {
        /* Sessions that repeat, so the prefix index and session affinity are exercised. */
        snprintf(session, sizeof session, "s-%d-%d", t, i % 7);
        snprintf(body, sizeof body,
                 "{\"model\":\"llama\",\"messages\":[{\"role\":\"system\",\"content\":\"You are agent %d. %s\"},"
                 "{\"role\":\"user\",\"content\":\"turn %d\"}],\"max_tokens\":64}",
                 t % 3, "Answer carefully and cite the documents you were given in the context window.", i % 5);
        kvroute_header h = {"x-session-id", 12, session, strlen(session)};
        kvroute_decision *d = NULL;
        kvroute_result r = kvroute_router_route(g_router, body, strlen(body), &h, 1, 1000 + (uint64_t)i, &d);
        if (r != KVROUTE_RESULT_OK) {
            fail("route", r);
            continue;
        }
        if (kvroute_decision_endpoint(d, ep, sizeof ep, NULL) != KVROUTE_RESULT_OK ||
            strncmp(ep, "10.0.", 5) != 0 || kvroute_decision_mode(d) == KVROUTE_MODE_NONE) {
            fail("decision", KVROUTE_RESULT_OK);
        }
        /* The shared decision, read concurrently by every thread. */
        char shared[64];
        if (kvroute_decision_endpoint(g_shared, shared, sizeof shared, NULL) != KVROUTE_RESULT_OK ||
            strcmp(shared, g_shared_endpoint) != 0 || kvroute_decision_score_count(g_shared) != ENDPOINTS) {
            fail("shared decision", KVROUTE_RESULT_OK);
        }
        if ((r = kvroute_decision_request_id(d, id, sizeof id, NULL)) != KVROUTE_RESULT_OK ||
            (r = kvroute_router_complete(g_router, id)) != KVROUTE_RESULT_OK) {
            fail("complete", r);
        }
        kvroute_decision_free(d);
        /* The last error is this thread's own. */
        if (i % 50 == 0) {
            char unknown[64], msg[256];
            snprintf(unknown, sizeof unknown, "unknown-%d-%d", t, i);
            if (kvroute_router_complete(g_router, unknown) != KVROUTE_RESULT_UNKNOWN_REQUEST ||
                kvroute_last_error_message(msg, sizeof msg, NULL) != KVROUTE_RESULT_OK || strstr(msg, unknown) == NULL) {
                fail("per-thread last error", KVROUTE_RESULT_OK);
            }
        }
    }
    atomic_fetch_add(&g_done_routers, 1);
    return NULL;
}

/* Metrics, reloads, KV events and stats while the routers run: at least MIN_ADMIN_ROUNDS rounds
 * whatever the scheduling (under valgrind one thread runs at a time, so the routers may all be
 * done before this thread first runs), then until every router is done. */
#define MIN_ADMIN_ROUNDS 3
static void *admin_thread(void *arg) {
    (void)arg;
    char ep[64];
    int round = 0;
    size_t payload_len = 0;
    unsigned char *payload = hex_decode(EVENT_HEX, &payload_len);
    while (round < MIN_ADMIN_ROUNDS || atomic_load(&g_done_routers) < THREADS) {
        for (int i = 0; i < ENDPOINTS; i++) {
            endpoint_id(i, ep, sizeof ep);
            kvroute_metrics m = {0};
            m.waiting = (uint32_t)((i + round) % 4);
            m.running = 4;
            m.kv_usage = 0.1 + 0.05 * (i % 5);
            m.updated_ms = 1000 + (uint64_t)round;
            kvroute_result r = kvroute_router_update_metrics(g_router, ep, &m);
            if (r != KVROUTE_RESULT_OK) fail("update_metrics", r);
        }
        const char *policy = (round % 2) ? "{\"scoring\": {\"weights\": {\"queue\": 2.0}}}" : "{}";
        kvroute_result r = kvroute_router_reload(g_router, policy, strlen(policy), NULL);
        if (r != KVROUTE_RESULT_OK) fail("reload", r);
        kvroute_stats st;
        if ((r = kvroute_router_stats(g_router, &st)) != KVROUTE_RESULT_OK || st.endpoints != ENDPOINTS) {
            fail("stats", r);
        }
        char *text = dup_router_text(kvroute_router_stats_json, g_router);
        if (text == NULL) fail("stats_json", KVROUTE_RESULT_OK);
        free(text);
        endpoint_id(round % ENDPOINTS, ep, sizeof ep);
        kvroute_apply_outcome o;
        r = kvroute_router_apply_events(g_router, ep, payload, payload_len, NULL, 1000 + (uint64_t)round, &o);
        if (r != KVROUTE_RESULT_OK || o.verdict != KVROUTE_VERDICT_APPLIED || o.blocks != 2) {
            fail("apply_events", r);
        } else {
            atomic_fetch_add(&g_batches, 1);
        }
        round++;
    }
    free(payload);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc > 1) g_routes = atoi(argv[1]);
    CHECK_OK(kvroute_router_new(NULL, 0, &g_router));
    char ep[64];
    for (int i = 0; i < ENDPOINTS; i++) {
        endpoint_id(i, ep, sizeof ep);
        CHECK_OK(kvroute_router_upsert_endpoint(g_router, ep, KVROUTE_ROLE_DECODE));
        kvroute_metrics m = {0};
        m.running = 4;
        m.kv_usage = 0.2;
        m.updated_ms = 1000;
        CHECK_OK(kvroute_router_update_metrics(g_router, ep, &m));
    }
    const char *body = "{\"model\":\"llama\",\"prompt\":\"shared decision\",\"max_tokens\":8}";
    kvroute_decision *shared = NULL;
    CHECK_OK(kvroute_router_route(g_router, body, strlen(body), NULL, 0, 1000, &shared));
    CHECK_OK(kvroute_decision_endpoint(shared, g_shared_endpoint, sizeof g_shared_endpoint, NULL));
    g_shared = shared;

    pthread_t routers[THREADS], admin;
    for (int t = 0; t < THREADS; t++) CHECK(pthread_create(&routers[t], NULL, router_thread, (void *)(intptr_t)t) == 0);
    CHECK(pthread_create(&admin, NULL, admin_thread, NULL) == 0);
    for (int t = 0; t < THREADS; t++) pthread_join(routers[t], NULL);
    pthread_join(admin, NULL);

    CHECK(atomic_load(&g_errors) == 0);
    char id[64];
    CHECK_OK(kvroute_decision_request_id(shared, id, sizeof id, NULL));
    CHECK_OK(kvroute_router_complete(g_router, id));
    kvroute_decision_free(shared);
    kvroute_stats st;
    CHECK_OK(kvroute_router_stats(g_router, &st));
    CHECK(st.counters.routed == (uint64_t)THREADS * (uint64_t)g_routes + 1);
    CHECK(st.inflight_requests == 0);
    CHECK(st.counters.route_errors == 0);
    uint64_t by_rule = 0;
    for (int k = 0; k < 8; k++) by_rule += st.counters.decisions_by_rule[k];
    CHECK(by_rule == st.counters.routed);
    CHECK(atomic_load(&g_batches) >= MIN_ADMIN_ROUNDS && st.precise.batches == (uint64_t)atomic_load(&g_batches));
    printf("threads: %d threads x %d routes, %llu reloads meanwhile\n", THREADS, g_routes,
           (unsigned long long)st.counters.reloads);
    kvroute_router_free(g_router);
    return finish("threads");
}
