/* Bad input through the C API: NULL pointers, truncated buffers, malformed policy documents,
 * request bodies, headers and KV-event payloads, invalid UTF-8, unknown ids. Every call must
 * return the documented code, leave its out-parameters alone, and record a useful last error. */
#include <math.h>

#include "common.h"

#define SENTINEL ((void *)0x1)

static const char BODY[] = "{\"model\":\"m\",\"prompt\":\"hello there\",\"max_tokens\":10}";

/* A KV-event batch (vLLM map encoding) storing 2 blocks of 16 tokens: [ts, [event], dp_rank]. */
static const char *EVENT_HEX =
    "93cb3ff000000000000091"                             /* array(3), ts=1.0, array(1) */
    "88"                                                 /* map(8) */
    "a474797065ab426c6f636b53746f726564"                 /* type: BlockStored */
    "ac626c6f636b5f686173686573920102"                   /* block_hashes: [1, 2] */
    "b1706172656e745f626c6f636b5f68617368c0"             /* parent_block_hash: nil */
    "a9746f6b656e5f696473dc0020"                         /* token_ids: array16(32) */
    "000102030405060708090a0b0c0d0e0f"
    "101112131415161718191a1b1c1d1e1f"
    "aa626c6f636b5f73697a6510"                           /* block_size: 16 */
    "a76c6f72615f6964c0"                                 /* lora_id: nil */
    "a66d656469756da3475055"                             /* medium: GPU */
    "a96c6f72615f6e616d65c0"                             /* lora_name: nil */
    "00";                                                /* dp_rank 0 */

static kvroute_router *make_router(void) {
    kvroute_router *r = NULL;
    CHECK_OK(kvroute_router_new(NULL, 0, &r));
    CHECK_OK(kvroute_router_upsert_endpoint(r, "10.0.0.1:8000", KVROUTE_ROLE_DECODE));
    return r;
}

static void null_arguments(void) {
    kvroute_router *r = make_router();
    kvroute_router *out = SENTINEL;
    CHECK_CODE(kvroute_router_new("{}", 2, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_new(NULL, 5, &out), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK(out == SENTINEL);
    CHECK(strstr(last_error(), "kvroute_router_new: `config` is NULL") != NULL);
    CHECK_CODE(kvroute_router_reload(NULL, "{}", 2, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_upsert_endpoint(NULL, "10.0.0.2:8000", KVROUTE_ROLE_DECODE), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_upsert_endpoint(r, NULL, KVROUTE_ROLE_DECODE), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_remove_endpoint(r, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_set_healthy(NULL, "10.0.0.1:8000", true), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_update_metrics(r, "10.0.0.1:8000", NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    kvroute_metrics m = {0};
    m.lora_running_len = 2; /* with a NULL array */
    CHECK_CODE(kvroute_router_update_metrics(r, "10.0.0.1:8000", &m), KVROUTE_RESULT_NULL_ARGUMENT);
    const char *names[] = {"a", NULL};
    m.lora_running = names;
    CHECK_CODE(kvroute_router_update_metrics(r, "10.0.0.1:8000", &m), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_update_metrics_from_prometheus(r, "10.0.0.1:8000", NULL, 3, 0, NULL),
               KVROUTE_RESULT_NULL_ARGUMENT);
    kvroute_decision *d = SENTINEL;
    CHECK_CODE(kvroute_router_route(NULL, BODY, strlen(BODY), NULL, 0, 1, &d), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_route(r, NULL, 10, NULL, 0, 1, &d), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_route(r, BODY, strlen(BODY), NULL, 1, 1, &d), KVROUTE_RESULT_NULL_ARGUMENT);
    kvroute_header h = {NULL, 4, "v", 1};
    CHECK_CODE(kvroute_router_route(r, BODY, strlen(BODY), &h, 1, 1, &d), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_route(r, BODY, strlen(BODY), NULL, 0, 1, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK(d == SENTINEL);
    CHECK_CODE(kvroute_router_complete(r, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_complete(NULL, "x"), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_apply_events(NULL, "10.0.0.1:8000", NULL, 0, NULL, 0, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_apply_events(r, NULL, NULL, 0, NULL, 0, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_update_metrics(NULL, "10.0.0.1:8000", &m), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_update_metrics(r, NULL, &m), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_update_metrics_from_prometheus(NULL, "10.0.0.1:8000", "", 0, 0, NULL),
               KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_update_metrics_from_prometheus(r, NULL, "", 0, 0, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_apply_events(r, "10.0.0.1:8000", NULL, 4, NULL, 0, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_resync_stream(r, NULL, 0), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_record_replay(NULL, "10.0.0.1:8000", true), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_set_tokenizer(NULL, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_metrics_text(NULL, 0, NULL, 0, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_stats(r, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_stats_json(NULL, NULL, 0, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_endpoints_json(NULL, NULL, 0, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_policy_json(NULL, NULL, 0, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_fail_open_endpoint(NULL, NULL, 0, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_record_effects(NULL, true), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_apply_effect(r, NULL, 3), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK(kvroute_router_policy_version(NULL) == 0);

    /* Decision accessors with a NULL decision: codes, or the documented fallbacks. */
    char buf[64];
    size_t needed = 12345;
    CHECK_CODE(kvroute_decision_request_id(NULL, buf, sizeof buf, &needed), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK(needed == 12345);
    CHECK_CODE(kvroute_decision_endpoint(NULL, buf, sizeof buf, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_decision_header(NULL, "x", buf, sizeof buf, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_decision_judgment(NULL, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_decision_score(NULL, 0, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_decision_to_json(NULL, NULL, 0, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_decision_effect(NULL, NULL, 0, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_decision_prefill_endpoint(NULL, buf, sizeof buf, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_decision_shed_reason(NULL, buf, sizeof buf, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_decision_header_name(NULL, 0, buf, sizeof buf, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_decision_header_value(NULL, 0, buf, sizeof buf, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_decision_score_endpoint(NULL, 0, buf, sizeof buf, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    kvroute_transfer tr;
    CHECK_CODE(kvroute_decision_transfer(NULL, &tr), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK(kvroute_decision_mode(NULL) == KVROUTE_MODE_NONE);
    CHECK(kvroute_decision_rule(NULL) == KVROUTE_RULE_NONE);
    CHECK(kvroute_decision_policy_version(NULL) == 0);
    CHECK(!kvroute_decision_is_shed(NULL));
    CHECK(kvroute_decision_shed_status(NULL) == 0);
    CHECK(kvroute_decision_header_count(NULL) == 0);
    CHECK(kvroute_decision_score_count(NULL) == 0);
    CHECK(kvroute_decision_prefix_hit(NULL) == 0.0);
    CHECK(kvroute_decision_cached_tokens(NULL) == 0);
    CHECK(kvroute_decision_input_tokens(NULL) == 0);
    CHECK(kvroute_decision_saturation(NULL) == 0.0);
    CHECK(!kvroute_decision_relaxed_filters(NULL));

    /* Subscriptions. */
    kvroute_subscription *s = SENTINEL;
    kvroute_subscriber_config cfg = {0};
    CHECK_CODE(kvroute_subscription_start(NULL, "10.0.0.1:8000", &cfg, &s), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_subscription_start(r, "10.0.0.1:8000", NULL, &s), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_subscription_start(r, "10.0.0.1:8000", &cfg, &s), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK(s == SENTINEL);
    CHECK_CODE(kvroute_subscription_stats(NULL, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_subscription_stop(NULL, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_subscription_local_endpoint(NULL, NULL, 0, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_subscription_endpoint(NULL, NULL, 0, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    /* The last error's copies: a NULL buffer with a length is refused (this error names no field
     * or header: those answer ABSENT first), and the error stays. */
    CHECK_CODE(kvroute_last_error_message(NULL, 8, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_last_error_field(NULL, 8, NULL), KVROUTE_RESULT_ABSENT);
    CHECK_CODE(kvroute_last_error_header(NULL, 8, NULL), KVROUTE_RESULT_ABSENT);
    CHECK(kvroute_last_error_code() == KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK(strstr(last_error(), "kvroute_subscription_endpoint") != NULL);
    CHECK(!kvroute_subscription_is_running(NULL));

    /* Every _free accepts NULL. */
    kvroute_router_free(NULL);
    kvroute_decision_free(NULL);
    kvroute_subscription_free(NULL);
    kvroute_router_free(r);
}

static void buffers(void) {
    kvroute_router *r = make_router();
    kvroute_header h = {"x-request-id", 12, "request-with-a-long-id", 22};
    kvroute_decision *d = NULL;
    CHECK_OK(kvroute_router_route(r, BODY, strlen(BODY), &h, 1, 1, &d));
    CHECK(d != NULL);
    /* Size query: NULL buffer of length 0. */
    size_t needed = 0;
    CHECK_CODE(kvroute_decision_request_id(d, NULL, 0, &needed), KVROUTE_RESULT_BUFFER_TOO_SMALL);
    CHECK(needed == strlen("request-with-a-long-id") + 1);
    /* One byte short: untouched buffer, same `needed`. */
    char buf[64];
    memset(buf, '#', sizeof buf);
    needed = 0;
    CHECK_CODE(kvroute_decision_request_id(d, buf, 22, &needed), KVROUTE_RESULT_BUFFER_TOO_SMALL);
    CHECK(needed == 23);
    for (int i = 0; i < 64; i++) CHECK(buf[i] == '#');
    /* Exactly enough. */
    CHECK_OK(kvroute_decision_request_id(d, buf, 23, &needed));
    CHECK_STR(buf, "request-with-a-long-id");
    CHECK(buf[23] == '#');
    /* A NULL buffer with a non-zero length is an error, and `needed` is not written then. */
    needed = 777;
    CHECK_CODE(kvroute_decision_request_id(d, NULL, 5, &needed), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK(needed == 777);
    /* The answers BUFFER_TOO_SMALL and ABSENT do not overwrite the last error. */
    CHECK_CODE(kvroute_router_complete(r, "no-such-request"), KVROUTE_RESULT_UNKNOWN_REQUEST);
    CHECK_CODE(kvroute_decision_endpoint(d, buf, 1, NULL), KVROUTE_RESULT_BUFFER_TOO_SMALL);
    CHECK_CODE(kvroute_decision_prefill_endpoint(d, buf, sizeof buf, NULL), KVROUTE_RESULT_ABSENT);
    CHECK(kvroute_last_error_code() == KVROUTE_RESULT_UNKNOWN_REQUEST);
    CHECK(strstr(last_error(), "no-such-request") != NULL);
    /* The last error itself, truncated: the size query does not overwrite it either. */
    size_t need_msg = 0;
    CHECK_CODE(kvroute_last_error_message(buf, 4, &need_msg), KVROUTE_RESULT_BUFFER_TOO_SMALL);
    CHECK(need_msg == strlen(last_error()) + 1);
    CHECK_CODE(kvroute_last_error_field(buf, sizeof buf, NULL), KVROUTE_RESULT_ABSENT);
    /* Indexes out of range. */
    size_t n = kvroute_decision_header_count(d);
    CHECK(n == 2);
    CHECK_CODE(kvroute_decision_header_name(d, n, buf, sizeof buf, NULL), KVROUTE_RESULT_OUT_OF_RANGE);
    CHECK_CODE(kvroute_decision_header_value(d, (size_t)-1, buf, sizeof buf, NULL), KVROUTE_RESULT_OUT_OF_RANGE);
    kvroute_endpoint_score sc;
    memset(&sc, 0x5A, sizeof sc);
    CHECK_CODE(kvroute_decision_score(d, 1, &sc), KVROUTE_RESULT_OUT_OF_RANGE);
    unsigned char *p = (unsigned char *)&sc;
    for (size_t i = 0; i < sizeof sc; i++) CHECK(p[i] == 0x5A);
    CHECK_CODE(kvroute_decision_score_endpoint(d, 1, buf, sizeof buf, NULL), KVROUTE_RESULT_OUT_OF_RANGE);
    CHECK_CODE(kvroute_decision_header(d, "x-no-such-header", buf, sizeof buf, NULL), KVROUTE_RESULT_ABSENT);
    CHECK_CODE(kvroute_decision_shed_reason(d, buf, sizeof buf, NULL), KVROUTE_RESULT_ABSENT);
    kvroute_transfer t;
    CHECK_CODE(kvroute_decision_transfer(d, &t), KVROUTE_RESULT_ABSENT);
    CHECK_CODE(kvroute_decision_effect(d, NULL, 0, NULL), KVROUTE_RESULT_ABSENT);
    /* Router texts: size query then a copy (retrying while they grow). */
    char *json = dup_router_text(kvroute_router_policy_json, r);
    CHECK(json != NULL && strstr(json, "\"modes\"") != NULL);
    free(json);
    CHECK_CODE(kvroute_router_metrics_text(r, 1, buf, 8, &needed), KVROUTE_RESULT_BUFFER_TOO_SMALL);
    CHECK(needed > 100);
    char id[64];
    CHECK_OK(kvroute_decision_request_id(d, id, sizeof id, NULL));
    CHECK_OK(kvroute_router_complete(r, id));
    kvroute_decision_free(d);
    kvroute_router_free(r);
}

static void malformed_documents(void) {
    kvroute_router *r = SENTINEL;
    const char *bad_json = "{\"modes\": {\"decode_kv_ceiling\": \"high\"}}";
    CHECK_CODE(kvroute_router_new(bad_json, strlen(bad_json), &r), KVROUTE_RESULT_CONFIG_ERROR);
    CHECK(r == SENTINEL);
    char field[128];
    CHECK_OK(kvroute_last_error_field(field, sizeof field, NULL));
    CHECK_STR(field, "modes.decode_kv_ceiling");
    const char *truncated = "{\"modes\": {";
    CHECK_CODE(kvroute_router_new(truncated, strlen(truncated), &r), KVROUTE_RESULT_CONFIG_ERROR);
    const char *unknown = "modes:\n  no_such_knob: 1\n";
    CHECK_CODE(kvroute_router_new(unknown, strlen(unknown), &r), KVROUTE_RESULT_CONFIG_ERROR);
    CHECK(strstr(last_error(), "no_such_knob") != NULL);
    const char *invalid = "{\"modes\": {\"decode_kv_ceiling\": 7}}";
    CHECK_CODE(kvroute_router_new(invalid, strlen(invalid), &r), KVROUTE_RESULT_CONFIG_ERROR);
    CHECK_OK(kvroute_last_error_field(field, sizeof field, NULL));
    CHECK_STR(field, "modes.decode_kv_ceiling");
    const char bad_utf8[] = {'{', '"', (char)0xff, '"', '}'};
    CHECK_CODE(kvroute_router_new(bad_utf8, sizeof bad_utf8, &r), KVROUTE_RESULT_INVALID_UTF8);
    CHECK(r == SENTINEL);

    /* A rejected reload leaves the old policy serving. */
    r = make_router();
    uint64_t version = 99;
    CHECK_CODE(kvroute_router_reload(r, bad_json, strlen(bad_json), &version), KVROUTE_RESULT_CONFIG_ERROR);
    CHECK(version == 99);
    CHECK(kvroute_router_policy_version(r) == 1);
    /* Only the first 2 bytes of a valid document: still an error, not a read past the length. */
    CHECK_CODE(kvroute_router_reload(r, "{\"modes\": {}}", 2, NULL), KVROUTE_RESULT_CONFIG_ERROR);
    kvroute_stats st;
    CHECK_OK(kvroute_router_stats(r, &st));
    CHECK(st.counters.reload_failures == 2);
    kvroute_router_free(r);
}

static void malformed_requests(void) {
    kvroute_router *r = make_router();
    kvroute_decision *d = SENTINEL;
    const char *not_json = "{\"model\": \"m\", \"prompt\": ";
    CHECK_CODE(kvroute_router_route(r, not_json, strlen(not_json), NULL, 0, 1, &d), KVROUTE_RESULT_REQUEST_ERROR);
    const char *no_model = "{\"prompt\": \"x\"}";
    CHECK_CODE(kvroute_router_route(r, no_model, strlen(no_model), NULL, 0, 1, &d), KVROUTE_RESULT_REQUEST_ERROR);
    char got[128];
    CHECK_OK(kvroute_last_error_field(got, sizeof got, NULL));
    CHECK_STR(got, "model");
    CHECK_CODE(kvroute_last_error_header(got, sizeof got, NULL), KVROUTE_RESULT_ABSENT);
    const char *bad_msg = "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": 5}]}";
    CHECK_CODE(kvroute_router_route(r, bad_msg, strlen(bad_msg), NULL, 0, 1, &d), KVROUTE_RESULT_REQUEST_ERROR);
    CHECK_OK(kvroute_last_error_field(got, sizeof got, NULL));
    CHECK_STR(got, "messages[0].content");
    CHECK_CODE(kvroute_router_route(r, "", 0, NULL, 0, 1, &d), KVROUTE_RESULT_REQUEST_ERROR);
    CHECK_CODE(kvroute_router_route(r, NULL, 0, NULL, 0, 1, &d), KVROUTE_RESULT_REQUEST_ERROR);
    /* Only the declared length is read: a valid body cut short is malformed. */
    CHECK_CODE(kvroute_router_route(r, BODY, 10, NULL, 0, 1, &d), KVROUTE_RESULT_REQUEST_ERROR);
    kvroute_header risk = {"x-kvroute-risk", 14, "eleven", 6};
    CHECK_CODE(kvroute_router_route(r, BODY, strlen(BODY), &risk, 1, 1, &d), KVROUTE_RESULT_REQUEST_ERROR);
    CHECK_OK(kvroute_last_error_header(got, sizeof got, NULL));
    CHECK_STR(got, "x-kvroute-risk");
    kvroute_header bad = {"x-session-id", 12, "\xc3\x28", 2};
    CHECK_CODE(kvroute_router_route(r, BODY, strlen(BODY), &bad, 1, 1, &d), KVROUTE_RESULT_INVALID_UTF8);
    CHECK(strstr(last_error(), "header value") != NULL);
    CHECK(d == SENTINEL);
    /* No endpoint can serve. */
    kvroute_router *empty = NULL;
    CHECK_OK(kvroute_router_new(NULL, 0, &empty));
    CHECK_CODE(kvroute_router_route(empty, BODY, strlen(BODY), NULL, 0, 1, &d), KVROUTE_RESULT_NO_ENDPOINTS);
    CHECK(d == SENTINEL);
    kvroute_router_free(empty);
    kvroute_stats st;
    CHECK_OK(kvroute_router_stats(r, &st));
    CHECK(st.counters.route_errors >= 6);
    CHECK(st.inflight_requests == 0);
    kvroute_router_free(r);
}

static void malformed_events_and_state(void) {
    kvroute_router *r = make_router();
    size_t len = 0;
    unsigned char *payload = hex_decode(EVENT_HEX, &len);
    kvroute_apply_outcome o;
    memset(&o, 0x77, sizeof o);
    /* Every truncation of a valid batch is a decode error that changes nothing. */
    for (size_t cut = 0; cut < len; cut++) {
        kvroute_result res = kvroute_router_apply_events(r, "10.0.0.1:8000", payload, cut, NULL, 1, &o);
        if (res != KVROUTE_RESULT_EVENT_DECODE_ERROR) {
            g_failures++;
            fprintf(stderr, "truncated payload (%zu of %zu bytes) gave %s\n", cut, len, code_name(res));
        }
    }
    g_checks++;
    CHECK(o.verdict == 0x77777777u);
    /* Garbage and a wrong type. */
    const unsigned char garbage[] = {0xc1, 0xc1, 0xc1};
    CHECK_CODE(kvroute_router_apply_events(r, "10.0.0.1:8000", garbage, sizeof garbage, NULL, 1, &o),
               KVROUTE_RESULT_EVENT_DECODE_ERROR);
    const unsigned char map[] = {0x80};
    CHECK_CODE(kvroute_router_apply_events(r, "10.0.0.1:8000", map, sizeof map, NULL, 1, &o),
               KVROUTE_RESULT_EVENT_DECODE_ERROR);
    kvroute_stats st;
    CHECK_OK(kvroute_router_stats(r, &st));
    CHECK(st.precise.batches == 0);
    /* The whole payload applies, for a known endpoint only. */
    uint64_t seq = 5;
    CHECK_CODE(kvroute_router_apply_events(r, "10.9.9.9:8000", payload, len, &seq, 1, &o),
               KVROUTE_RESULT_UNKNOWN_ENDPOINT);
    CHECK_OK(kvroute_router_apply_events(r, "10.0.0.1:8000", payload, len, &seq, 1, &o));
    CHECK(o.verdict == KVROUTE_VERDICT_APPLIED && o.blocks == 2 && o.events == 1);
    free(payload);

    /* Metrics pages. */
    const char *page = "garbage line without a value\n";
    CHECK_CODE(kvroute_router_update_metrics_from_prometheus(r, "10.0.0.1:8000", page, strlen(page), 1, NULL),
               KVROUTE_RESULT_METRICS_PARSE_ERROR);
    const char *other = "# HELP x y\nsome_other_metric 3\n";
    CHECK_CODE(kvroute_router_update_metrics_from_prometheus(r, "10.0.0.1:8000", other, strlen(other), 1, NULL),
               KVROUTE_RESULT_METRICS_PARSE_ERROR);
    const char *vllm = "vllm:num_requests_waiting{model_name=\"m\"} 2\n";
    CHECK_CODE(kvroute_router_update_metrics_from_prometheus(r, "10.9.9.9:8000", vllm, strlen(vllm), 1, NULL),
               KVROUTE_RESULT_UNKNOWN_ENDPOINT);

    /* Endpoint table and request tracking. */
    CHECK_CODE(kvroute_router_upsert_endpoint(r, "not-an-endpoint", KVROUTE_ROLE_DECODE),
               KVROUTE_RESULT_INVALID_ENDPOINT_ID);
    CHECK_CODE(kvroute_router_upsert_endpoint(r, "10.0.0.2:8000", 0), KVROUTE_RESULT_INVALID_ARGUMENT);
    CHECK_CODE(kvroute_router_upsert_endpoint(r, "10.0.0.2:8000", 42), KVROUTE_RESULT_INVALID_ARGUMENT);
    CHECK_CODE(kvroute_router_upsert_endpoint(r, "10.0.0.2:\xff", KVROUTE_ROLE_DECODE), KVROUTE_RESULT_INVALID_UTF8);
    CHECK_CODE(kvroute_router_remove_endpoint(r, "10.0.0.9:8000"), KVROUTE_RESULT_UNKNOWN_ENDPOINT);
    CHECK_CODE(kvroute_router_set_healthy(r, "10.0.0.9:8000", false), KVROUTE_RESULT_UNKNOWN_ENDPOINT);
    CHECK_CODE(kvroute_router_resync_stream(r, "10.0.0.9:8000", 1), KVROUTE_RESULT_UNKNOWN_ENDPOINT);
    CHECK_CODE(kvroute_router_record_replay(r, "10.0.0.9:8000", true), KVROUTE_RESULT_UNKNOWN_ENDPOINT);
    kvroute_metrics m = {0};
    m.kv_usage = 1.5;
    CHECK_CODE(kvroute_router_update_metrics(r, "10.0.0.1:8000", &m), KVROUTE_RESULT_INVALID_METRICS);
    char field[64];
    CHECK_OK(kvroute_last_error_field(field, sizeof field, NULL));
    CHECK_STR(field, "kv_usage");
    m.kv_usage = NAN;
    CHECK_CODE(kvroute_router_update_metrics(r, "10.0.0.1:8000", &m), KVROUTE_RESULT_INVALID_METRICS);
    CHECK_CODE(kvroute_router_complete(r, "never-routed"), KVROUTE_RESULT_UNKNOWN_REQUEST);
    const char *limited = "{\"limits\": {\"max_endpoints\": 1}}";
    CHECK_OK(kvroute_router_reload(r, limited, strlen(limited), NULL));
    CHECK_CODE(kvroute_router_upsert_endpoint(r, "10.0.0.2:8000", KVROUTE_ROLE_DECODE),
               KVROUTE_RESULT_TOO_MANY_ENDPOINTS);

    /* Effects: malformed bytes. */
    const unsigned char effect[] = {1, 200, 0, 0};
    CHECK_CODE(kvroute_router_apply_effect(r, effect, sizeof effect), KVROUTE_RESULT_EFFECT_DECODE_ERROR);
    const unsigned char version[] = {99};
    CHECK_CODE(kvroute_router_apply_effect(r, version, sizeof version), KVROUTE_RESULT_EFFECT_DECODE_ERROR);

    /* Subscriptions: invalid configurations. */
    kvroute_subscription *s = SENTINEL;
    kvroute_subscriber_config cfg = {0};
    cfg.endpoint = "no-transport";
    kvroute_result res = kvroute_subscription_start(r, "10.0.0.1:8000", &cfg, &s);
    if (res != KVROUTE_RESULT_UNSUPPORTED) {
        CHECK(res == KVROUTE_RESULT_SUBSCRIBE_ERROR);
        CHECK_OK(kvroute_last_error_field(field, sizeof field, NULL));
        CHECK_STR(field, "endpoint");
        cfg.endpoint = "tcp://127.0.0.1:5557";
        cfg.mode = 9;
        CHECK_CODE(kvroute_subscription_start(r, "10.0.0.1:8000", &cfg, &s), KVROUTE_RESULT_INVALID_ARGUMENT);
        cfg.mode = KVROUTE_SOCKET_MODE_CONNECT;
        cfg.poll_interval_ms = 1000000000;
        CHECK_CODE(kvroute_subscription_start(r, "10.0.0.1:8000", &cfg, &s), KVROUTE_RESULT_SUBSCRIBE_ERROR);
        cfg.poll_interval_ms = 0;
        CHECK_CODE(kvroute_subscription_start(r, "bad id", &cfg, &s), KVROUTE_RESULT_INVALID_ENDPOINT_ID);
        cfg.endpoint = "nosuchtransport://x";
        CHECK_CODE(kvroute_subscription_start(r, "10.0.0.1:8000", &cfg, &s), KVROUTE_RESULT_SUBSCRIBE_ERROR);
    }
    CHECK(s == SENTINEL);
    /* Tokenizer: a file that does not exist. */
    res = kvroute_router_set_tokenizer(r, "/nonexistent/tokenizer.json");
    CHECK(res == KVROUTE_RESULT_TOKENIZER_ERROR || res == KVROUTE_RESULT_UNSUPPORTED);
    kvroute_router_free(r);
}

static void names(void) {
    CHECK_STR(kvroute_result_name(KVROUTE_RESULT_OK), "KVROUTE_RESULT_OK");
    CHECK_STR(kvroute_result_name(KVROUTE_RESULT_PANIC), "KVROUTE_RESULT_PANIC");
    CHECK(kvroute_result_name(9999) == NULL);
    CHECK(kvroute_result_name(-1) == NULL);
    /* The codes are stable: these numbers are part of the ABI. */
    CHECK(KVROUTE_RESULT_OK == 0 && KVROUTE_RESULT_NULL_ARGUMENT == 1 && KVROUTE_RESULT_INVALID_UTF8 == 2);
    CHECK(KVROUTE_RESULT_BUFFER_TOO_SMALL == 4 && KVROUTE_RESULT_CONFIG_ERROR == 10);
    CHECK(KVROUTE_RESULT_REQUEST_ERROR == 11 && KVROUTE_RESULT_NO_ENDPOINTS == 12);
    CHECK(KVROUTE_RESULT_UNKNOWN_ENDPOINT == 13 && KVROUTE_RESULT_UNKNOWN_REQUEST == 17);
    CHECK(KVROUTE_RESULT_EVENT_DECODE_ERROR == 18 && KVROUTE_RESULT_SUBSCRIBE_ERROR == 20);
    CHECK(KVROUTE_RESULT_PANIC == 30 && KVROUTE_RESULT_INTERNAL == 31);
    CHECK(kvroute_mode_name(KVROUTE_MODE_NONE) == NULL);
    CHECK(kvroute_role_name(0) == NULL && kvroute_verdict_name(0) == NULL && kvroute_filter_name(0) == NULL);
    CHECK(kvroute_rule_name(123) == NULL && kvroute_horizon_name(0) == NULL);
    CHECK(kvroute_judgment_source_name(7) == NULL);
}

int main(void) {
    null_arguments();
    buffers();
    malformed_documents();
    malformed_requests();
    malformed_events_and_state();
    names();
    return finish("errors");
}
