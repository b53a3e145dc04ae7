/* Route a request with libkvroute and print the decision.
 *
 * Two decode endpoints report their load; the same chat request (a long system prompt and a
 * question) is routed twice. The first time no endpoint holds its KV cache, so it is scored on
 * load alone; the second time the router remembers where the prompt went and sends it there
 * (decode-direct, prefix hit 1.0).
 *
 * Build and run against the build tree:
 *   cargo build --release -p kvroute-ffi
 *   export PKG_CONFIG_PATH=target/release
 *   cc -o route ffi/examples/route.c $(pkg-config --cflags --libs kvroute)
 *   LD_LIBRARY_PATH=target/release ./route
 *
 * Exits 0 when both routes succeeded and the second one went where the first one did. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvroute.h"

/* Print the failing call's code and message, then exit. */
static void fail(const char *what, kvroute_result r) {
    char msg[1024];
    if (kvroute_last_error_message(msg, sizeof msg, NULL) != KVROUTE_RESULT_OK) msg[0] = '\0';
    fprintf(stderr, "%s failed: %s: %s\n", what, kvroute_result_name(r), msg);
    exit(1);
}

#define TRY(call)                                          \
    do {                                                   \
        kvroute_result r_ = (call);                        \
        if (r_ != KVROUTE_RESULT_OK) fail(#call, r_);      \
    } while (0)

/* A decision string accessor, into a caller buffer; "-" when absent. */
static const char *text_of(kvroute_result (*get)(const kvroute_decision *, char *, size_t, size_t *),
                           const kvroute_decision *d, char *buf, size_t len) {
    kvroute_result r = get(d, buf, len, NULL);
    if (r == KVROUTE_RESULT_ABSENT) return "-";
    if (r != KVROUTE_RESULT_OK) fail("decision accessor", r);
    return buf;
}

static void print_decision(const kvroute_decision *d) {
    char buf[256], name[128], value[256];
    const char *mode = kvroute_mode_name(kvroute_decision_mode(d));
    printf("  request id:       %s\n", text_of(kvroute_decision_request_id, d, buf, sizeof buf));
    printf("  mode:             %s\n", mode ? mode : "(shed)");
    printf("  rule:             %s\n", kvroute_rule_name(kvroute_decision_rule(d)));
    printf("  endpoint:         %s\n", text_of(kvroute_decision_endpoint, d, buf, sizeof buf));
    printf("  prefill endpoint: %s\n", text_of(kvroute_decision_prefill_endpoint, d, buf, sizeof buf));
    printf("  policy version:   %llu\n", (unsigned long long)kvroute_decision_policy_version(d));
    printf("  prefix hit:       %.2f (%llu of %llu input tokens cached)\n", kvroute_decision_prefix_hit(d),
           (unsigned long long)kvroute_decision_cached_tokens(d),
           (unsigned long long)kvroute_decision_input_tokens(d));
    printf("  headers:\n");
    for (size_t i = 0; i < kvroute_decision_header_count(d); i++) {
        TRY(kvroute_decision_header_name(d, i, name, sizeof name, NULL));
        TRY(kvroute_decision_header_value(d, i, value, sizeof value, NULL));
        printf("    %s: %s\n", name, value);
    }
    printf("  scores:\n");
    for (size_t i = 0; i < kvroute_decision_score_count(d); i++) {
        kvroute_endpoint_score s;
        TRY(kvroute_decision_score_endpoint(d, i, buf, sizeof buf, NULL));
        TRY(kvroute_decision_score(d, i, &s));
        const char *filtered = kvroute_filter_name(s.filtered);
        printf("    %-15s total %.3f (prefix hit %.2f, queue %.2f, kv usage %.2f)%s%s\n", buf, s.total,
               s.prefix_hit, s.queue, s.kv_usage, filtered ? ", filtered: " : "", filtered ? filtered : "");
    }
}

int main(void) {
    printf("libkvroute %s\n", kvroute_version());

    /* The policy: JSON (or YAML), pointer + length. Only what differs from the defaults. */
    const char *policy = "{\"metrics\": {\"staleness_ms\": 60000}}";
    kvroute_router *router = NULL;
    TRY(kvroute_router_new(policy, strlen(policy), &router));

    const char *endpoints[] = {"10.0.0.1:8000", "10.0.0.2:8000"};
    uint64_t now = kvroute_now_ms();
    for (int i = 0; i < 2; i++) {
        TRY(kvroute_router_upsert_endpoint(router, endpoints[i], KVROUTE_ROLE_DECODE));
        kvroute_metrics m = {0}; /* zero-initialized: the optional fields are unset */
        m.waiting = (uint32_t)i;
        m.running = 4;
        m.kv_usage = 0.25;
        m.updated_ms = now;
        TRY(kvroute_router_update_metrics(router, endpoints[i], &m));
    }

    /* A chat request with a long shared system prompt. */
    char system[4096] = "";
    while (strlen(system) + 64 < sizeof system) {
        strcat(system, "You are a careful assistant; cite the documents you were given. ");
    }
    char body[8192];
    snprintf(body, sizeof body,
             "{\"model\":\"llama\",\"max_tokens\":512,\"messages\":[{\"role\":\"system\",\"content\":\"%s\"},"
             "{\"role\":\"user\",\"content\":\"What changed in the last release?\"}]}",
             system);
    kvroute_header headers[] = {{"x-session-id", 12, "session-42", 10}};

    char first[64] = "", second[64] = "", id[128];
    for (int round = 1; round <= 2; round++) {
        kvroute_decision *d = NULL;
        TRY(kvroute_router_route(router, body, strlen(body), headers, 1, now + (uint64_t)round, &d));
        printf("decision %d:\n", round);
        print_decision(d);
        TRY(kvroute_decision_endpoint(d, round == 1 ? first : second, sizeof first, NULL));
        /* ... forward the request to the endpoint, with the decision's headers; when the response
         * has finished: */
        TRY(kvroute_decision_request_id(d, id, sizeof id, NULL));
        TRY(kvroute_router_complete(router, id));
        kvroute_decision_free(d);
    }

    kvroute_router_free(router);
    if (strcmp(first, second) != 0) {
        fprintf(stderr, "the repeated request went to %s, not to %s where its prefix is cached\n", second, first);
        return 1;
    }
    return 0;
}
