/* A tour of the whole C API with values checked: construction from YAML and JSON, reload,
 * the endpoint table, metrics (fields and Prometheus pages), routing and every decision
 * accessor (decode-direct, colocated, disaggregated with its transfer estimate, shed), complete,
 * KV events (applied, duplicate, gap, resync), routing effects between two routers, the
 * tokenizer, stats, metrics text and the JSON views.
 *
 * Usage: api FIXTURES_DIR */
#include "common.h"

static const char *D1 = "10.0.0.1:8000";
static const char *D2 = "10.0.0.2:8000";
static const char *P1 = "10.0.1.1:8000";

static void set_metrics(kvroute_router *r, const char *ep, uint32_t waiting, uint32_t running, double kv) {
    kvroute_metrics m = {0};
    m.waiting = waiting;
    m.running = running;
    m.kv_usage = kv;
    m.updated_ms = 1000;
    CHECK_OK(kvroute_router_update_metrics(r, ep, &m));
}

/* `n` bytes of prompt text, deterministic per seed. */
static char *prompt_text(unsigned seed, size_t n) {
    static const char *words[] = {"alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta"};
    char *s = malloc(n + 16);
    size_t len = 0;
    unsigned x = seed * 2654435761u + 1;
    while (len < n) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        const char *w = words[x % 8];
        memcpy(s + len, w, strlen(w));
        len += strlen(w);
        s[len++] = ' ';
    }
    s[n] = '\0';
    return s;
}

static char *completion_body(const char *prompt, int max_tokens) {
    size_t n = strlen(prompt) + 128;
    char *b = malloc(n);
    snprintf(b, n, "{\"model\":\"llama\",\"prompt\":\"%s\",\"max_tokens\":%d}", prompt, max_tokens);
    return b;
}

static kvroute_decision *route(kvroute_router *r, const char *body, const kvroute_header *h, size_t nh, uint64_t now) {
    kvroute_decision *d = NULL;
    CHECK_OK(kvroute_router_route(r, body, strlen(body), h, nh, now, &d));
    return d;
}

static void complete(kvroute_router *r, const kvroute_decision *d) {
    char id[128];
    CHECK_OK(kvroute_decision_request_id(d, id, sizeof id, NULL));
    CHECK_OK(kvroute_router_complete(r, id));
}

static void library(void) {
    const char *v = kvroute_version();
    CHECK(v != NULL && v[0] >= '0' && v[0] <= '9' && strchr(v, '.') != NULL);
    uint64_t now = kvroute_now_ms();
    CHECK(now > 1600000000000ull);
}

static void config_and_endpoints(void) {
    const char *yaml = "modes:\n  colocated_input_max_tokens: 256\nmetrics:\n  staleness_ms: 60000\n";
    kvroute_router *r = NULL;
    CHECK_OK(kvroute_router_new(yaml, strlen(yaml), &r));
    CHECK(kvroute_router_policy_version(r) == 1);
    char *policy = dup_router_text(kvroute_router_policy_json, r);
    CHECK(policy && strstr(policy, "\"colocated_input_max_tokens\": 256") != NULL);
    free(policy);
    const char *json = "{\"modes\": {\"colocated_input_max_tokens\": 128}}";
    uint64_t version = 0;
    CHECK_OK(kvroute_router_reload(r, json, strlen(json), &version));
    CHECK(version == 2 && kvroute_router_policy_version(r) == 2);
    policy = dup_router_text(kvroute_router_policy_json, r);
    CHECK(policy && strstr(policy, "\"colocated_input_max_tokens\": 128") != NULL);
    free(policy);
    CHECK_OK(kvroute_router_reload(r, yaml, strlen(yaml), NULL));
    CHECK(kvroute_router_policy_version(r) == 3);

    CHECK_OK(kvroute_router_upsert_endpoint(r, D1, KVROUTE_ROLE_DECODE));
    CHECK_OK(kvroute_router_upsert_endpoint(r, D2, KVROUTE_ROLE_BOTH));
    CHECK_OK(kvroute_router_upsert_endpoint(r, "[::1]:8000", KVROUTE_ROLE_PREFILL));
    CHECK_OK(kvroute_router_upsert_endpoint(r, "[::1]:8000", KVROUTE_ROLE_DECODE)); /* role change */
    CHECK_OK(kvroute_router_remove_endpoint(r, "[::1]:8000"));
    const char *running[] = {"adapter-a", "adapter-b"};
    const char *waiting[] = {"adapter-c"};
    kvroute_metrics m = {0};
    m.waiting = 3;
    m.running = 7;
    m.kv_usage = 0.25;
    m.lora_running = running;
    m.lora_running_len = 2;
    m.lora_waiting = waiting;
    m.lora_waiting_len = 1;
    m.has_max_lora = true;
    m.max_lora = 4;
    m.has_kv_capacity_tokens = true;
    m.kv_capacity_tokens = 123456;
    m.updated_ms = 500;
    CHECK_OK(kvroute_router_update_metrics(r, D1, &m));
    CHECK_OK(kvroute_router_set_healthy(r, D2, false));
    const char *page =
        "# HELP vllm:num_requests_waiting waiting\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        "vllm:num_requests_waiting{model_name=\"llama\"} 2.0\n"
        "vllm:num_requests_running{model_name=\"llama\"} 5.0\n"
        "vllm:gpu_cache_usage_perc{model_name=\"llama\"} 0.5\n";
    kvroute_metrics_snapshot snap;
    memset(&snap, 0, sizeof snap);
    CHECK_OK(kvroute_router_update_metrics_from_prometheus(r, D2, page, strlen(page), 900, &snap));
    CHECK(snap.waiting == 2 && snap.running == 5 && snap.kv_usage == 0.5 && snap.updated_ms == 900);
    CHECK(!snap.has_max_lora && snap.lora_running_count == 0);
    CHECK_OK(kvroute_router_update_metrics_from_prometheus(r, D2, page, strlen(page), 901, NULL));

    /* Fail-open destination: the healthy decode-capable endpoint (D2 is unhealthy now); a too
     * small buffer is left untouched; a router without endpoints has none. */
    char fo[32];
    size_t fo_need = 0;
    memset(fo, 'x', sizeof fo);
    CHECK_CODE(kvroute_router_fail_open_endpoint(r, fo, 4, &fo_need), KVROUTE_RESULT_BUFFER_TOO_SMALL);
    CHECK(fo_need == strlen(D1) + 1 && fo[0] == 'x');
    CHECK_OK(kvroute_router_fail_open_endpoint(r, fo, sizeof fo, NULL));
    CHECK(strcmp(fo, D1) == 0);
    kvroute_router *empty = NULL;
    CHECK_OK(kvroute_router_new(NULL, 0, &empty));
    CHECK_CODE(kvroute_router_fail_open_endpoint(empty, fo, sizeof fo, NULL), KVROUTE_RESULT_ABSENT);
    kvroute_router_free(empty);

    char *eps = dup_router_text(kvroute_router_endpoints_json, r);
    CHECK(eps != NULL);
    if (eps) {
        CHECK(strstr(eps, "\"id\":\"10.0.0.1:8000\"") != NULL);
        CHECK(strstr(eps, "\"lora_running\":[\"adapter-a\",\"adapter-b\"]") != NULL);
        CHECK(strstr(eps, "\"max_lora\":4") != NULL);
        CHECK(strstr(eps, "\"kv_capacity_tokens\":123456") != NULL);
        CHECK(strstr(eps, "\"healthy\":false") != NULL);
        CHECK(strstr(eps, "\"updated_ms\":901") != NULL);
        CHECK(strstr(eps, "[::1]") == NULL);
    }
    free(eps);
    kvroute_stats st;
    CHECK_OK(kvroute_router_stats(r, &st));
    CHECK(st.policy_version == 3 && st.endpoints == 2 && st.counters.reloads == 2);
    kvroute_router_free(r);
}

static void decisions(void) {
    kvroute_router *r = NULL;
    CHECK_OK(kvroute_router_new(NULL, 0, &r));
    CHECK_OK(kvroute_router_upsert_endpoint(r, D1, KVROUTE_ROLE_DECODE));
    CHECK_OK(kvroute_router_upsert_endpoint(r, D2, KVROUTE_ROLE_DECODE));
    set_metrics(r, D1, 0, 2, 0.2);
    set_metrics(r, D2, 1, 2, 0.3);

    /* A short completion: colocated fast path, derived judgment. */
    kvroute_header hs[] = {{"X-Request-Id", 12, "req-1", 5}, {"x-session-id", 12, "sess-9", 6}};
    const char *small = "{\"model\":\"llama\",\"prompt\":\"Say hi.\",\"max_tokens\":16}";
    kvroute_decision *d = route(r, small, hs, 2, 1000);
    CHECK(kvroute_decision_mode(d) == KVROUTE_MODE_COLOCATED);
    CHECK(kvroute_decision_rule(d) == KVROUTE_RULE_COLOCATED_FAST_PATH);
    CHECK_STR(kvroute_mode_name(kvroute_decision_mode(d)), "colocated");
    CHECK_STR(kvroute_rule_name(kvroute_decision_rule(d)), "colocated_fast_path");
    CHECK(kvroute_decision_policy_version(d) == 1);
    char buf[256];
    CHECK_OK(kvroute_decision_request_id(d, buf, sizeof buf, NULL));
    CHECK_STR(buf, "req-1");
    CHECK_OK(kvroute_decision_endpoint(d, buf, sizeof buf, NULL));
    CHECK_STR(buf, D1);
    CHECK(!kvroute_decision_is_shed(d) && kvroute_decision_shed_status(d) == 0);
    CHECK(kvroute_decision_header_count(d) == 2);
    CHECK_OK(kvroute_decision_header_name(d, 0, buf, sizeof buf, NULL));
    CHECK_STR(buf, "x-gateway-destination-endpoint");
    CHECK_OK(kvroute_decision_header_value(d, 0, buf, sizeof buf, NULL));
    CHECK_STR(buf, D1);
    CHECK_OK(kvroute_decision_header(d, "x-kvroute-mode", buf, sizeof buf, NULL));
    CHECK_STR(buf, "colocated");
    CHECK(kvroute_decision_prefix_hit(d) == 0.0 && kvroute_decision_cached_tokens(d) == 0);
    CHECK(kvroute_decision_input_tokens(d) == 2); /* 8 bytes of prompt, 4 per pseudo-token */
    CHECK(!kvroute_decision_relaxed_filters(d));
    CHECK(kvroute_decision_saturation(d) >= 0.0);
    kvroute_judgment j;
    memset(&j, 0, sizeof j);
    CHECK_OK(kvroute_decision_judgment(d, &j));
    CHECK(j.horizon == KVROUTE_HORIZON_SHORT && j.risk == 0 && !j.has_bypass_probability);
    CHECK(j.source == KVROUTE_JUDGMENT_SOURCE_DERIVED);
    CHECK(kvroute_decision_score_count(d) == 2);
    kvroute_endpoint_score s0, s1;
    CHECK_OK(kvroute_decision_score(d, 0, &s0));
    CHECK_OK(kvroute_decision_score(d, 1, &s1));
    CHECK_OK(kvroute_decision_score_endpoint(d, 1, buf, sizeof buf, NULL));
    CHECK_STR(buf, D2);
    CHECK(s0.role == KVROUTE_ROLE_DECODE && s0.filtered == KVROUTE_FILTER_NONE && s0.total > s1.total);
    CHECK(s1.queue > 0.0 && s1.kv_usage == 0.3);
    char *json = dup_string(kvroute_decision_to_json, d);
    CHECK(json && strstr(json, "\"request_id\":\"req-1\"") && strstr(json, "\"rule\":\"colocated_fast_path\""));
    free(json);
    /* A second request with the same id while the first is in flight gets a unique id. */
    kvroute_decision *d2 = route(r, small, hs, 2, 1001);
    CHECK_OK(kvroute_decision_request_id(d2, buf, sizeof buf, NULL));
    CHECK(strcmp(buf, "req-1") != 0 && strncmp(buf, "req-1", 5) == 0);
    complete(r, d2);
    kvroute_decision_free(d2);
    complete(r, d);
    CHECK_CODE(kvroute_router_complete(r, "req-1"), KVROUTE_RESULT_UNKNOWN_REQUEST);
    kvroute_decision_free(d);

    /* A long prompt twice: the second goes decode-direct to the same endpoint. Hint headers. */
    char *prompt = prompt_text(7, 16000);
    char *body = completion_body(prompt, 300);
    d = route(r, body, NULL, 0, 1100);
    char first[64];
    CHECK_OK(kvroute_decision_endpoint(d, first, sizeof first, NULL));
    complete(r, d);
    kvroute_decision_free(d);
    kvroute_header hint[] = {{"x-kvroute-horizon", 17, "long", 4}, {"x-kvroute-risk", 14, "2", 1},
                             {"x-kvroute-bypass-probability", 28, "0.95", 4}};
    d = route(r, body, hint, 3, 1200);
    CHECK(kvroute_decision_mode(d) == KVROUTE_MODE_DECODE_DIRECT);
    CHECK_OK(kvroute_decision_endpoint(d, buf, sizeof buf, NULL));
    CHECK_STR(buf, first);
    CHECK(kvroute_decision_prefix_hit(d) > 0.95);
    CHECK(kvroute_decision_cached_tokens(d) > 3900 && kvroute_decision_input_tokens(d) == 4000);
    CHECK_OK(kvroute_decision_judgment(d, &j));
    CHECK(j.horizon == KVROUTE_HORIZON_LONG && j.risk == 2 && j.has_bypass_probability);
    CHECK(j.bypass_probability == 0.95 && j.source == KVROUTE_JUDGMENT_SOURCE_HINT);
    complete(r, d);
    kvroute_decision_free(d);
    free(body);
    free(prompt);

    kvroute_stats st;
    CHECK_OK(kvroute_router_stats(r, &st));
    CHECK(st.inflight_requests == 0 && st.counters.routed == 4);
    CHECK(st.counters.decisions_by_rule[KVROUTE_RULE_COLOCATED_FAST_PATH] == 2);
    CHECK(st.counters.decisions_by_rule[KVROUTE_RULE_DECODE_DIRECT] == 1);
    CHECK(st.counters.decisions_by_rule[KVROUTE_RULE_NONE] == 0);
    CHECK(st.index.memberships > 0 && st.index.memory_bytes > 0);
    char *sj = dup_router_text(kvroute_router_stats_json, r);
    CHECK(sj && strstr(sj, "\"policy_version\":1") && strstr(sj, "\"routed\":4"));
    free(sj);
    size_t need = 0;
    CHECK_CODE(kvroute_router_metrics_text(r, 2000, NULL, 0, &need), KVROUTE_RESULT_BUFFER_TOO_SMALL);
    char *text = malloc(need + 4096);
    CHECK_OK(kvroute_router_metrics_text(r, 2000, text, need + 4096, NULL));
    CHECK(strstr(text, "# TYPE") != NULL && strstr(text, "decode_direct") != NULL);
    free(text);
    kvroute_router_free(r);
}

static void disaggregated_and_shed(void) {
    kvroute_router *r = NULL;
    CHECK_OK(kvroute_router_new(NULL, 0, &r));
    CHECK_OK(kvroute_router_upsert_endpoint(r, D1, KVROUTE_ROLE_DECODE));
    CHECK_OK(kvroute_router_upsert_endpoint(r, P1, KVROUTE_ROLE_PREFILL));
    set_metrics(r, D1, 0, 8, 0.3);
    set_metrics(r, P1, 0, 0, 0.1);
    char *prompt = prompt_text(11, 8000);
    char *body = completion_body(prompt, 300);
    kvroute_decision *d = route(r, body, NULL, 0, 1100);
    CHECK(kvroute_decision_mode(d) == KVROUTE_MODE_DISAGGREGATED);
    CHECK(kvroute_decision_rule(d) == KVROUTE_RULE_DISAGGREGATED);
    char buf[256];
    CHECK_OK(kvroute_decision_prefill_endpoint(d, buf, sizeof buf, NULL));
    CHECK_STR(buf, P1);
    CHECK_OK(kvroute_decision_header(d, "x-prefiller-host-port", buf, sizeof buf, NULL));
    CHECK_STR(buf, P1);
    kvroute_transfer t;
    memset(&t, 0, sizeof t);
    CHECK_OK(kvroute_decision_transfer(d, &t));
    CHECK(t.pays && t.tokens == 2000 && t.kv_bytes == 2000ull * 131072ull);
    CHECK(t.transfer_s > 0.0 && t.disaggregated_cost_s < t.colocated_cost_s);
    complete(r, d);
    kvroute_decision_free(d);
    free(body);
    free(prompt);

    /* Saturated pool, sheddable request: shed with a reason. */
    set_metrics(r, D1, 6, 8, 0.3);
    kvroute_header prio = {"x-kvroute-priority", 18, "-1", 2};
    const char *small = "{\"model\":\"llama\",\"prompt\":\"Say hi.\",\"max_tokens\":16}";
    d = route(r, small, &prio, 1, 1200);
    CHECK(kvroute_decision_is_shed(d));
    CHECK(kvroute_decision_shed_status(d) == 429);
    CHECK(kvroute_decision_mode(d) == KVROUTE_MODE_NONE);
    CHECK(kvroute_decision_rule(d) == KVROUTE_RULE_SHED);
    CHECK_CODE(kvroute_decision_endpoint(d, buf, sizeof buf, NULL), KVROUTE_RESULT_ABSENT);
    char reason[256], header[256];
    CHECK_OK(kvroute_decision_shed_reason(d, reason, sizeof reason, NULL));
    CHECK(strstr(reason, "saturated") != NULL);
    CHECK_OK(kvroute_decision_header(d, "x-kvroute-shed-reason", header, sizeof header, NULL));
    CHECK_STR(header, reason);
    kvroute_decision_free(d);
    kvroute_router_free(r);
}

/* A vLLM BlockStored batch (map encoding) of 2 blocks of 16 tokens, token ids 0..31. */
static const char *EVENT_HEX =
    "93cb3ff0000000000000918"
    "8a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573920102b1706172656e745f626c6f636b5f68617368"
    "c0a9746f6b656e5f696473dc0020000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1faa626c6f63"
    "6b5f73697a6510a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c000";

static void events(void) {
    const char *precise = "{\"index\": {\"mode\": \"precise\", \"block_tokens\": 16}}";
    kvroute_router *r = NULL;
    CHECK_OK(kvroute_router_new(precise, strlen(precise), &r));
    CHECK_OK(kvroute_router_upsert_endpoint(r, D1, KVROUTE_ROLE_DECODE));
    CHECK_OK(kvroute_router_upsert_endpoint(r, D2, KVROUTE_ROLE_DECODE));
    set_metrics(r, D1, 0, 0, 0.2);
    set_metrics(r, D2, 1, 0, 0.2);
    size_t len = 0;
    unsigned char *payload = hex_decode(EVENT_HEX, &len);
    kvroute_apply_outcome o;
    uint64_t seq = 0;
    CHECK_OK(kvroute_router_apply_events(r, D2, payload, len, &seq, 1000, &o));
    CHECK(o.verdict == KVROUTE_VERDICT_APPLIED && o.blocks == 2 && o.events == 1 && o.expected == 0);
    CHECK_OK(kvroute_router_apply_events(r, D2, payload, len, &seq, 1000, &o));
    CHECK(o.verdict == KVROUTE_VERDICT_DUPLICATE);
    seq = 5;
    CHECK_OK(kvroute_router_apply_events(r, D2, payload, len, &seq, 1000, &o));
    CHECK(o.verdict == KVROUTE_VERDICT_GAP && o.expected == 1 && o.got == 5);
    CHECK_STR(kvroute_verdict_name(o.verdict), "gap");
    CHECK_OK(kvroute_router_record_replay(r, D2, false));
    CHECK_OK(kvroute_router_resync_stream(r, D2, 1001));
    CHECK_OK(kvroute_router_apply_events(r, D2, payload, len, &seq, 1002, &o));
    CHECK(o.verdict == KVROUTE_VERDICT_APPLIED);
    CHECK_OK(kvroute_router_apply_events(r, D2, payload, len, NULL, 1003, NULL)); /* no seq, no outcome */
    kvroute_stats st;
    CHECK_OK(kvroute_router_stats(r, &st));
    CHECK(st.precise.gaps == 1 && st.precise.resyncs == 1 && st.precise.duplicates == 1);
    CHECK(st.precise.replay_failures == 1 && st.precise.blocks_stored >= 4);
    /* Token ids 0..31: both blocks cached on D2 (after the resync's stale window, in precise
     * mode the match counts anyway). */
    const char *body = "{\"model\":\"m\",\"prompt\":[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,"
                       "24,25,26,27,28,29,30,31],\"max_tokens\":300}";
    kvroute_decision *d = route(r, body, NULL, 0, 1004);
    kvroute_endpoint_score s;
    CHECK_OK(kvroute_decision_score(d, 1, &s));
    CHECK(s.precise && s.matched_blocks == 2 && s.cached_tokens == 32);
    complete(r, d);
    kvroute_decision_free(d);
    free(payload);
    kvroute_router_free(r);
}

static void effects(void) {
    kvroute_router *a = NULL, *b = NULL;
    CHECK_OK(kvroute_router_new(NULL, 0, &a));
    CHECK_OK(kvroute_router_new(NULL, 0, &b));
    kvroute_router *both[] = {a, b};
    for (int i = 0; i < 2; i++) {
        CHECK_OK(kvroute_router_upsert_endpoint(both[i], D1, KVROUTE_ROLE_DECODE));
        CHECK_OK(kvroute_router_upsert_endpoint(both[i], D2, KVROUTE_ROLE_DECODE));
        set_metrics(both[i], D1, 0, 0, 0.2);
        set_metrics(both[i], D2, 0, 0, 0.2);
    }
    CHECK_OK(kvroute_router_record_effects(a, true));
    char *prompt = prompt_text(3, 8000);
    char *body = completion_body(prompt, 300);
    kvroute_header id = {"x-request-id", 12, "effect-1", 8};
    kvroute_decision *d = route(a, body, &id, 1, 1000);
    size_t need = 0;
    CHECK_CODE(kvroute_decision_effect(d, NULL, 0, &need), KVROUTE_RESULT_BUFFER_TOO_SMALL);
    CHECK(need > 8 * 31); /* 2000 pseudo-tokens: 31 block keys of 8 bytes */
    unsigned char *effect = malloc(need);
    size_t got = 0;
    CHECK_OK(kvroute_decision_effect(d, effect, need, &got));
    CHECK(got == need);
    char target[64];
    CHECK_OK(kvroute_decision_endpoint(d, target, sizeof target, NULL));
    /* Every truncation of a real effect is a decode error that applies nothing. */
    kvroute_stats st;
    for (size_t cut = 0; cut < need; cut++) {
        kvroute_result res = kvroute_router_apply_effect(b, effect, cut);
        g_checks++;
        if (res != KVROUTE_RESULT_EFFECT_DECODE_ERROR) {
            g_failures++;
            fprintf(stderr, "effect truncated to %zu of %zu bytes gave %s\n", cut, need, code_name(res));
        }
    }
    CHECK_OK(kvroute_router_stats(b, &st));
    CHECK(st.inflight_requests == 0 && st.index.memberships == 0);
    /* A router without the target endpoint refuses it whole. */
    kvroute_router *c = NULL;
    CHECK_OK(kvroute_router_new(NULL, 0, &c));
    CHECK_CODE(kvroute_router_apply_effect(c, effect, need), KVROUTE_RESULT_UNKNOWN_ENDPOINT);
    CHECK_OK(kvroute_router_stats(c, &st));
    CHECK(st.inflight_requests == 0 && st.index.memberships == 0);
    kvroute_router_free(c);
    CHECK_OK(kvroute_router_apply_effect(b, effect, need));
    CHECK_OK(kvroute_router_stats(b, &st));
    CHECK(st.inflight_requests == 1 && st.index.memberships > 0);
    /* Router b now believes the target holds the prompt: it routes there, decode-direct. */
    kvroute_decision *db = route(b, body, NULL, 0, 1001);
    char there[64];
    CHECK_OK(kvroute_decision_endpoint(db, there, sizeof there, NULL));
    CHECK_STR(there, target);
    CHECK(kvroute_decision_mode(db) == KVROUTE_MODE_DECODE_DIRECT);
    CHECK_CODE(kvroute_decision_effect(db, NULL, 0, NULL), KVROUTE_RESULT_ABSENT); /* b records none */
    complete(b, db);
    CHECK_OK(kvroute_router_complete(b, "effect-1"));
    complete(a, d);
    CHECK_OK(kvroute_router_record_effects(a, false));
    kvroute_decision_free(db);
    kvroute_decision_free(d);
    free(effect);
    free(body);
    free(prompt);
    kvroute_router_free(a);
    kvroute_router_free(b);
}

static void tokenizer(const char *fixtures) {
    char path[1024];
    snprintf(path, sizeof path, "%s/tokenizer", fixtures);
    const char *precise = "{\"index\": {\"mode\": \"precise\"}}";
    kvroute_router *r = NULL;
    CHECK_OK(kvroute_router_new(precise, strlen(precise), &r));
    CHECK_OK(kvroute_router_upsert_endpoint(r, D1, KVROUTE_ROLE_DECODE));
    set_metrics(r, D1, 0, 0, 0.2);
    kvroute_result res = kvroute_router_set_tokenizer(r, path);
    if (res == KVROUTE_RESULT_UNSUPPORTED) {
        kvroute_router_free(r);
        return;
    }
    CHECK(res == KVROUTE_RESULT_OK);
    snprintf(path, sizeof path, "%s/tokenizer/tokenizer.json", fixtures);
    CHECK_OK(kvroute_router_set_tokenizer(r, path));
    const char *chat = "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hello tokenizer\"}]}";
    kvroute_decision *d = route(r, chat, NULL, 0, 1000);
    CHECK(kvroute_decision_input_tokens(d) > 0);
    complete(r, d);
    kvroute_decision_free(d);
    CHECK_OK(kvroute_router_set_tokenizer(r, NULL));
    kvroute_router_free(r);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s FIXTURES_DIR\n", argv[0]);
        return 2;
    }
    library();
    config_and_endpoints();
    decisions();
    disaggregated_and_shed();
    events();
    effects();
    tokenizer(argv[1]);
    return finish("api");
}
