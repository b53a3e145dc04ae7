/* Per-call cost of `kvroute_router_route` from C, on the workload of
 * benches/benches/route.rs (parse_and_route): 64 decode endpoints, an index warmed by 256
 * earlier 8k-token requests (16 tenants with 2k-token system prompts), and a follow-up 8k-token
 * request with a partial prefix hit, as a 32 KB JSON body with one header. Each iteration is
 * route + request id + complete + free. The criterion bench ffi/benches/route_native.rs builds the
 * identical router and body and times the same request natively (`Router::route_http`) and
 * through this C API; ffi/bench/run.sh runs both.
 *
 * Timing: CLOCK_MONOTONIC around 5 rounds of ITERATIONS/5 calls each; prints the median round's
 * nanoseconds per call.
 *
 * Usage: route_bench [ITERATIONS]   (default 20000) */
#define _POSIX_C_SOURCE 200809L
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvroute.h"

#define ENDPOINTS 64
#define PROMPT_BYTES (8192 * 4)
#define NOW 1000

/* The text generator of benches/benches/route.rs (xorshift over 10 words), byte for byte. */
static char *text(uint64_t seed, size_t len) {
    static const char *words[] = {"alpha", "beta", "gamma", "delta", "omega",
                                  "kappa", "sigma", "theta", "lambda", "zeta"};
    uint64_t x = (seed * 0x9E3779B97F4A7C15ull) | 1;
    char *s = malloc(len + 16);
    size_t n = 0;
    while (n < len) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        const char *w = words[x % 10];
        size_t wl = strlen(w);
        memcpy(s + n, w, wl);
        n += wl;
        s[n++] = ' ';
    }
    s[len] = '\0';
    return s;
}

static void die(const char *what, kvroute_result r) {
    char msg[512];
    if (kvroute_last_error_message(msg, sizeof msg, NULL) != KVROUTE_RESULT_OK) msg[0] = '\0';
    fprintf(stderr, "%s: %s %s\n", what, kvroute_result_name(r), msg);
    exit(1);
}

static char *body_of(const char *prompt, int max_tokens) {
    size_t n = strlen(prompt) + 96;
    char *b = malloc(n);
    if (max_tokens > 0) {
        snprintf(b, n, "{\"max_tokens\":%d,\"model\":\"llama\",\"prompt\":\"%s\"}", max_tokens, prompt);
    } else {
        snprintf(b, n, "{\"model\":\"llama\",\"prompt\":\"%s\"}", prompt);
    }
    return b;
}

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    long iterations = argc > 1 ? atol(argv[1]) : 20000;
    kvroute_router *r = NULL;
    kvroute_result res;
    if ((res = kvroute_router_new(NULL, 0, &r)) != KVROUTE_RESULT_OK) die("new", res);
    for (int i = 0; i < ENDPOINTS; i++) {
        char id[64];
        snprintf(id, sizeof id, "10.%d.%d.%d:8000", i / 65536, (i / 256) % 256, i % 256);
        if ((res = kvroute_router_upsert_endpoint(r, id, KVROUTE_ROLE_DECODE)) != KVROUTE_RESULT_OK) die("upsert", res);
        kvroute_metrics m = {0};
        m.waiting = (uint32_t)(i % 4);
        m.running = 8;
        m.kv_usage = 0.3 + (double)(i % 5) * 0.05;
        m.updated_ms = NOW;
        if ((res = kvroute_router_update_metrics(r, id, &m)) != KVROUTE_RESULT_OK) die("metrics", res);
    }
    char *systems[16];
    for (int t = 0; t < 16; t++) systems[t] = text(1000 + (uint64_t)t, 2048 * 4);
    size_t sys_len = strlen(systems[0]);
    /* Warm-up: 256 requests kept in flight until the end (as live traffic), then completed. */
    int warm = 4 * ENDPOINTS;
    char (*ids)[64] = malloc(sizeof *ids * (size_t)warm);
    for (int w = 0; w < warm; w++) {
        char *tail = text((uint64_t)w, PROMPT_BYTES - sys_len);
        size_t n = sys_len + strlen(tail) + 1;
        char *prompt = malloc(n);
        snprintf(prompt, n, "%s%s", systems[w % 16], tail);
        char *body = body_of(prompt, 0);
        kvroute_decision *d = NULL;
        if ((res = kvroute_router_route(r, body, strlen(body), NULL, 0, NOW, &d)) != KVROUTE_RESULT_OK) die("warm", res);
        kvroute_decision_request_id(d, ids[w], sizeof ids[w], NULL);
        kvroute_decision_free(d);
        free(body);
        free(prompt);
        free(tail);
    }
    for (int w = 0; w < warm; w++) kvroute_router_complete(r, ids[w]);
    free(ids);
    /* The request: tenant 3's system prompt + an earlier conversation's tail (cached on one
     * endpoint) minus its last 4096 bytes + new text. */
    char *prior = text(3, PROMPT_BYTES - sys_len);
    prior[strlen(prior) - 4096] = '\0';
    size_t plen = sys_len + strlen(prior);
    char *prompt = malloc(PROMPT_BYTES + 1);
    snprintf(prompt, PROMPT_BYTES + 1, "%s%s", systems[3], prior);
    char *fresh = text(99, PROMPT_BYTES - plen);
    strcat(prompt, fresh);
    char *body = body_of(prompt, 256);
    size_t body_len = strlen(body);
    kvroute_header h = {"x-session-id", 12, "s", 1};

    kvroute_decision *d = NULL;
    if ((res = kvroute_router_route(r, body, body_len, &h, 1, NOW, &d)) != KVROUTE_RESULT_OK) die("route", res);
    double hit = kvroute_decision_prefix_hit(d);
    char id[64];
    kvroute_decision_request_id(d, id, sizeof id, NULL);
    kvroute_router_complete(r, id);
    kvroute_decision_free(d);
    if (!(hit > 0.5)) {
        fprintf(stderr, "the bench request should be a partial hit, got %f\n", hit);
        return 1;
    }

    double rounds[5], trivial[5];
    long per_round = iterations / 5 > 0 ? iterations / 5 : 1;
    for (int k = 0; k < 5; k++) {
        double t0 = now_ns();
        for (long i = 0; i < per_round; i++) {
            kvroute_router_route(r, body, body_len, &h, 1, NOW, &d);
            kvroute_decision_request_id(d, id, sizeof id, NULL);
            kvroute_router_complete(r, id);
            kvroute_decision_free(d);
        }
        rounds[k] = (now_ns() - t0) / (double)per_round;
    }
    /* A trivial call (one accessor): the cost of crossing the boundary, panic guard included. */
    kvroute_router_route(r, body, body_len, &h, 1, NOW, &d);
    volatile uint64_t sink = 0;
    for (int k = 0; k < 5; k++) {
        double t0 = now_ns();
        for (long i = 0; i < per_round * 100; i++) sink += kvroute_decision_cached_tokens(d);
        trivial[k] = (now_ns() - t0) / (double)(per_round * 100);
    }
    kvroute_decision_request_id(d, id, sizeof id, NULL);
    kvroute_router_complete(r, id);
    kvroute_decision_free(d);
    qsort(rounds, 5, sizeof *rounds, cmp);
    qsort(trivial, 5, sizeof *trivial, cmp);
    printf("C kvroute_router_route (+request_id, complete, free), 8k tokens, 64 endpoints, %zu-byte body: "
           "%.0f ns/call (median of 5 rounds of %ld; prefix hit %.2f)\n",
           body_len, rounds[2], per_round, hit);
    printf("C kvroute_decision_cached_tokens (boundary crossing): %.1f ns/call\n", trivial[2]);
    (void)sink;
    for (int t = 0; t < 16; t++) free(systems[t]);
    free(prior);
    free(prompt);
    free(fresh);
    free(body);
    kvroute_router_free(r);
    return 0;
}
