/* Flow control through the C API: admit (admit now / ticket / rejection), take_releases into a
 * caller buffer (too small: nothing lost, nothing reordered), cancel, tick, next deadline,
 * shutdown, stats, bands, saturation; every NULL and invalid argument; a seeded random sequence
 * of admissions, completions, takes with random buffer sizes, cancels, ticks, health flips and
 * reloads in which every ticket must end exactly once; and the same from several threads on one
 * router.
 *
 * Usage: flow [SCALE] (default 200: 20 x SCALE random steps, SCALE iterations per thread). */
#define _POSIX_C_SOURCE 200809L
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

#include <cJSON.h>

#include "common.h"

static const char *BODY = "{\"model\":\"m\",\"prompt\":\"hello\",\"max_tokens\":16}";
static const char *EP1 = "10.0.0.1:8000";
static const char *EP2 = "10.0.0.2:8000";

/* One endpoint, at most one request in flight: the second request queues. */
static const char *ONE_SLOT =
    "{\"flow_control\":{\"enabled\":true,\"saturation_detector\":{\"kind\":\"concurrency\","
    "\"max_requests_per_endpoint\":1}}}";

static kvroute_router *make(const char *policy, int endpoints) {
    kvroute_router *r = NULL;
    CHECK_OK(kvroute_router_new(policy, policy ? strlen(policy) : 0, &r));
    if (r == NULL) exit(1);
    if (endpoints >= 1) CHECK_OK(kvroute_router_upsert_endpoint(r, EP1, KVROUTE_ROLE_DECODE));
    if (endpoints >= 2) CHECK_OK(kvroute_router_upsert_endpoint(r, EP2, KVROUTE_ROLE_DECODE));
    return r;
}

static void set_header(kvroute_header *h, const char *name, const char *value) {
    h->name = name;
    h->name_len = strlen(name);
    h->value = value;
    h->value_len = strlen(value);
}

/* Admit a request of `tenant` with `priority` at `now`. */
static kvroute_result admit(kvroute_router *r, const char *tenant, int priority, uint64_t now, kvroute_admission *a) {
    char prio[16];
    snprintf(prio, sizeof prio, "%d", priority);
    kvroute_header h[2];
    set_header(&h[0], "x-llm-d-inference-fairness-id", tenant);
    set_header(&h[1], "x-kvroute-priority", prio);
    return kvroute_router_admit(r, BODY, strlen(BODY), h, 2, now, a);
}

/* Route a request at `now`; its request id goes to `rid` when routed (not shed). 1 when routed. */
static int route(kvroute_router *r, uint64_t now, char rid[128]) {
    kvroute_decision *d = NULL;
    kvroute_result res = kvroute_router_route(r, BODY, strlen(BODY), NULL, 0, now, &d);
    if (res != KVROUTE_RESULT_OK) {
        CHECK(res == KVROUTE_RESULT_NO_ENDPOINTS);
        return 0;
    }
    int routed = !kvroute_decision_is_shed(d);
    if (routed) CHECK_OK(kvroute_decision_request_id(d, rid, 128, NULL));
    kvroute_decision_free(d);
    return routed;
}

static kvroute_flow_stats stats(kvroute_router *r) {
    kvroute_flow_stats s;
    memset(&s, 0, sizeof s);
    CHECK_OK(kvroute_router_flow_stats(r, &s));
    return s;
}

static void check_rejection(const kvroute_rejection *rej, uint16_t status, kvroute_drop_reason reason) {
    CHECK(rej->status == status);
    CHECK(rej->reason == reason);
    CHECK_STR(rej->reason_name, kvroute_drop_reason_name(reason));
}

/* ---- names ---- */

static void test_names(void) {
    CHECK_STR(kvroute_header_dropped_reason(), "x-llm-d-request-dropped-reason");
    const char *names[] = {NULL,
                           "rejected-saturated",
                           "rejected-ttl-expired",
                           "rejected-no-endpoints",
                           "rejected-shutting-down",
                           "evicted-priority",
                           "evicted-queue-pressure"};
    CHECK(kvroute_drop_reason_name(KVROUTE_DROP_REASON_NONE) == NULL);
    for (kvroute_drop_reason k = 1; k <= 6; k++) CHECK_STR(kvroute_drop_reason_name(k), names[k]);
    CHECK(KVROUTE_DROP_REASON_REJECTED_SATURATED == 1 && KVROUTE_DROP_REASON_EVICTED_QUEUE_PRESSURE == 6);
    CHECK(kvroute_drop_reason_name(7) == NULL && kvroute_drop_reason_name(UINT32_MAX) == NULL);
    CHECK_STR(kvroute_admission_kind_name(KVROUTE_ADMISSION_ADMIT), "admit");
    CHECK_STR(kvroute_admission_kind_name(KVROUTE_ADMISSION_QUEUED), "queued");
    CHECK_STR(kvroute_admission_kind_name(KVROUTE_ADMISSION_REJECTED), "rejected");
    CHECK(kvroute_admission_kind_name(0) == NULL && kvroute_admission_kind_name(4) == NULL);
    CHECK_STR(kvroute_release_outcome_name(KVROUTE_RELEASE_DISPATCHED), "dispatched");
    CHECK_STR(kvroute_release_outcome_name(KVROUTE_RELEASE_DROPPED), "dropped");
    CHECK(kvroute_release_outcome_name(0) == NULL && kvroute_release_outcome_name(3) == NULL);
}

/* ---- flow control off: the protocol can be followed unconditionally ---- */

static void test_off(void) {
    kvroute_router *r = make(NULL, 1);
    for (int i = 0; i < 5; i++) {
        kvroute_admission a;
        memset(&a, 0xAB, sizeof a);
        CHECK_OK(admit(r, "t", -1, (uint64_t)i, &a));
        CHECK(a.kind == KVROUTE_ADMISSION_ADMIT && a.ticket == 0 && a.rejection.status == 0);
        CHECK(a.rejection.reason == KVROUTE_DROP_REASON_NONE && a.rejection.reason_name == NULL);
    }
    size_t n = 9, remaining = 9;
    kvroute_release buf[4];
    CHECK_OK(kvroute_router_take_releases(r, 10, buf, 4, &n, &remaining));
    CHECK(n == 0 && remaining == 0);
    uint64_t deadline = 77;
    CHECK_CODE(kvroute_router_next_flow_deadline(r, &deadline), KVROUTE_RESULT_ABSENT);
    CHECK(deadline == 77);
    kvroute_flow_stats s = stats(r);
    CHECK(!s.enabled && s.queued == 0 && s.admitted == 0 && s.enqueued == 0);
    kvroute_router_free(r);
}

/* ---- queued, released by a completion, routed ---- */

static void test_queued_released_by_completion(void) {
    kvroute_router *r = make(ONE_SLOT, 1);
    kvroute_admission a, b;
    CHECK_OK(admit(r, "t", 0, 100, &a));
    CHECK(a.kind == KVROUTE_ADMISSION_ADMIT);
    char rid_a[128], rid_b[128];
    CHECK(route(r, 100, rid_a));
    CHECK_OK(admit(r, "t", 0, 110, &b));
    CHECK(b.kind == KVROUTE_ADMISSION_QUEUED && b.ticket != 0);
    CHECK(b.rejection.status == 0 && b.rejection.reason_name == NULL);
    kvroute_flow_stats s = stats(r);
    CHECK(s.enabled && s.queued == 1 && s.queued_bytes == strlen(BODY) && s.admitted == 1 && s.enqueued == 1);
    uint64_t deadline = 0;
    CHECK_OK(kvroute_router_next_flow_deadline(r, &deadline));
    CHECK(deadline > 110 && deadline <= 110 + 30000); /* the default 30 s TTL, at the latest */
    kvroute_release rel[4];
    size_t n = 9, remaining = 9;
    /* Nothing is released while the slot is taken. */
    CHECK_OK(kvroute_router_take_releases(r, 120, rel, 4, &n, &remaining));
    CHECK(n == 0 && remaining == 0);
    CHECK_OK(kvroute_router_complete(r, rid_a));
    CHECK_OK(kvroute_router_take_releases(r, 130, rel, 4, &n, &remaining));
    CHECK(n == 1 && remaining == 0);
    CHECK(rel[0].ticket == b.ticket && rel[0].outcome == KVROUTE_RELEASE_DISPATCHED && rel[0].waited_ms == 20);
    CHECK(rel[0].rejection.status == 0 && rel[0].rejection.reason == KVROUTE_DROP_REASON_NONE &&
          rel[0].rejection.reason_name == NULL);
    /* Released and not routed yet: it counts as load. */
    s = stats(r);
    CHECK(s.queued == 0 && s.dispatched == 1 && s.pending_dispatch == 1 && s.releases_waiting == 0);
    CHECK(route(r, 130, rid_b));
    s = stats(r);
    CHECK(s.pending_dispatch == 0);
    CHECK_OK(kvroute_router_complete(r, rid_b));
    /* The ticket ended: cancelling it finds nothing. */
    bool found = true;
    CHECK_OK(kvroute_router_cancel(r, b.ticket, &found));
    CHECK(!found);
    /* A tick makes the releases; they wait for the next take. */
    kvroute_admission c, d;
    CHECK_OK(admit(r, "t", 0, 200, &c));
    CHECK(c.kind == KVROUTE_ADMISSION_ADMIT);
    char rid_c[128], rid_d[128];
    CHECK(route(r, 200, rid_c));
    CHECK_OK(admit(r, "t", 0, 201, &d));
    CHECK(d.kind == KVROUTE_ADMISSION_QUEUED && d.ticket != b.ticket);
    CHECK_OK(kvroute_router_complete(r, rid_c));
    CHECK_OK(kvroute_router_flow_tick(r, 205));
    s = stats(r);
    CHECK(s.releases_waiting == 1 && s.queued == 0);
    CHECK_OK(kvroute_router_take_releases(r, 206, rel, 4, &n, &remaining));
    CHECK(n == 1 && remaining == 0 && rel[0].ticket == d.ticket && rel[0].waited_ms == 4);
    CHECK(route(r, 206, rid_d));
    CHECK_OK(kvroute_router_complete(r, rid_d));
    kvroute_flow_saturation sat;
    memset(&sat, 0xAB, sizeof sat);
    CHECK_OK(kvroute_router_flow_saturation(r, 210, &sat));
    CHECK(sat.pool == 0.0 && sat.decode == 0.0 && !sat.has_prefill && sat.prefill == 0.0 && sat.decode_endpoints == 1);
    kvroute_router_free(r);
}

/* ---- every rejection: status, reason code, header value ---- */

static void test_rejections(void) {
    /* Capacity: the global limit (1 queued) -> 429 rejected-saturated. */
    kvroute_router *r = make(
        "{\"flow_control\":{\"enabled\":true,\"max_requests\":1,\"shedding\":{\"enabled\":false},"
        "\"saturation_detector\":{\"kind\":\"concurrency\",\"max_requests_per_endpoint\":1}}}",
        1);
    kvroute_admission a;
    char rid[128];
    CHECK_OK(admit(r, "t", 0, 0, &a));
    CHECK(a.kind == KVROUTE_ADMISSION_ADMIT);
    CHECK(route(r, 0, rid));
    CHECK_OK(admit(r, "t", 0, 1, &a));
    CHECK(a.kind == KVROUTE_ADMISSION_QUEUED);
    uint64_t queued = a.ticket;
    CHECK_OK(admit(r, "u", 0, 2, &a));
    CHECK(a.kind == KVROUTE_ADMISSION_REJECTED && a.ticket == 0);
    check_rejection(&a.rejection, 429, KVROUTE_DROP_REASON_REJECTED_SATURATED);
    /* A sheddable request queued, then a normal one arrives at a full queue: the sheddable one
     * is evicted (429 evicted-priority, as a release) and the normal one queues. */
    bool found = false;
    CHECK_OK(kvroute_router_cancel(r, queued, &found));
    CHECK(found);
    CHECK_OK(admit(r, "s", -1, 3, &a));
    CHECK(a.kind == KVROUTE_ADMISSION_QUEUED);
    uint64_t sheddable = a.ticket;
    CHECK_OK(admit(r, "t", 0, 4, &a));
    CHECK(a.kind == KVROUTE_ADMISSION_QUEUED);
    uint64_t normal = a.ticket;
    kvroute_release rel[4];
    size_t n = 0, remaining = 0;
    CHECK_OK(kvroute_router_take_releases(r, 5, rel, 4, &n, &remaining));
    CHECK(n == 1 && remaining == 0 && rel[0].ticket == sheddable && rel[0].outcome == KVROUTE_RELEASE_DROPPED);
    check_rejection(&rel[0].rejection, 429, KVROUTE_DROP_REASON_EVICTED_PRIORITY);
    CHECK(rel[0].waited_ms == 1);
    /* Shutdown: the queued one is dropped with 503 rejected-shutting-down, later admissions too. */
    CHECK_OK(kvroute_router_shutdown_queue(r));
    CHECK_OK(kvroute_router_take_releases(r, 6, rel, 4, &n, &remaining));
    CHECK(n == 1 && rel[0].ticket == normal && rel[0].outcome == KVROUTE_RELEASE_DROPPED);
    check_rejection(&rel[0].rejection, 503, KVROUTE_DROP_REASON_REJECTED_SHUTTING_DOWN);
    CHECK_OK(admit(r, "t", 5, 7, &a));
    CHECK(a.kind == KVROUTE_ADMISSION_REJECTED);
    check_rejection(&a.rejection, 503, KVROUTE_DROP_REASON_REJECTED_SHUTTING_DOWN);
    kvroute_flow_stats s = stats(r);
    CHECK(s.shutting_down && s.queued == 0 && s.enqueued == 3 && s.cancelled == 1);
    CHECK(s.rejections[0] == 0 && s.rejections[KVROUTE_DROP_REASON_REJECTED_SATURATED] == 1 &&
          s.rejections[KVROUTE_DROP_REASON_EVICTED_PRIORITY] == 1 &&
          s.rejections[KVROUTE_DROP_REASON_REJECTED_SHUTTING_DOWN] == 2);
    CHECK_OK(kvroute_router_complete(r, rid));
    kvroute_router_free(r);

    /* TTL: 429 rejected-ttl-expired at the deadline next_flow_deadline announced. */
    r = make(
        "{\"flow_control\":{\"enabled\":true,\"default_request_ttl_ms\":100,\"saturation_detector\":{\"kind\":"
        "\"concurrency\",\"max_requests_per_endpoint\":1}}}",
        1);
    CHECK_OK(admit(r, "t", 0, 1000, &a));
    CHECK(route(r, 1000, rid));
    CHECK_OK(admit(r, "t", 0, 1000, &a));
    CHECK(a.kind == KVROUTE_ADMISSION_QUEUED);
    uint64_t deadline = 0;
    CHECK_OK(kvroute_router_next_flow_deadline(r, &deadline));
    CHECK(deadline >= 1000 && deadline <= 1100);
    CHECK_OK(kvroute_router_take_releases(r, 1099, rel, 4, &n, &remaining));
    CHECK(n == 0);
    CHECK_OK(kvroute_router_take_releases(r, 1100, rel, 4, &n, &remaining));
    CHECK(n == 1 && rel[0].ticket == a.ticket && rel[0].outcome == KVROUTE_RELEASE_DROPPED && rel[0].waited_ms == 100);
    check_rejection(&rel[0].rejection, 429, KVROUTE_DROP_REASON_REJECTED_TTL_EXPIRED);
    CHECK_CODE(kvroute_router_next_flow_deadline(r, &deadline), KVROUTE_RESULT_ABSENT);
    CHECK_OK(kvroute_router_complete(r, rid));
    kvroute_router_free(r);

    /* No endpoint at all, refused at once: 503 rejected-no-endpoints. */
    r = make("{\"flow_control\":{\"enabled\":true,\"no_endpoints_ttl_ms\":0}}", 0);
    CHECK_OK(admit(r, "t", 0, 0, &a));
    CHECK(a.kind == KVROUTE_ADMISSION_REJECTED);
    check_rejection(&a.rejection, 503, KVROUTE_DROP_REASON_REJECTED_NO_ENDPOINTS);
    kvroute_flow_saturation sat;
    CHECK_OK(kvroute_router_flow_saturation(r, 0, &sat));
    CHECK(sat.decode_endpoints == 0);
    kvroute_router_free(r);
}

/* ---- cancel ---- */

static void test_cancel(void) {
    kvroute_router *r = make(ONE_SLOT, 1);
    kvroute_admission a;
    char rid[128];
    CHECK_OK(admit(r, "t", 0, 0, &a));
    CHECK(route(r, 0, rid));
    uint64_t t[3];
    for (int i = 0; i < 3; i++) {
        CHECK_OK(admit(r, "t", 0, (uint64_t)(1 + i), &a));
        CHECK(a.kind == KVROUTE_ADMISSION_QUEUED);
        t[i] = a.ticket;
    }
    CHECK(t[0] != t[1] && t[1] != t[2] && t[0] != t[2]);
    bool found = false;
    CHECK_OK(kvroute_router_cancel(r, t[0], &found));
    CHECK(found);
    found = true;
    CHECK_OK(kvroute_router_cancel(r, t[0], &found));
    CHECK(!found);
    found = true;
    CHECK_OK(kvroute_router_cancel(r, 0, &found)); /* never issued */
    CHECK(!found);
    CHECK_OK(kvroute_router_cancel(r, t[2], NULL)); /* `found` is optional */
    /* Released by a tick, not yet taken: still cancellable; it never appears in a release. */
    CHECK_OK(kvroute_router_complete(r, rid));
    CHECK_OK(kvroute_router_flow_tick(r, 10));
    CHECK(stats(r).releases_waiting == 1);
    found = false;
    CHECK_OK(kvroute_router_cancel(r, t[1], &found));
    CHECK(found);
    kvroute_release rel[4];
    size_t n = 9, remaining = 9;
    CHECK_OK(kvroute_router_take_releases(r, 11, rel, 4, &n, &remaining));
    CHECK(n == 0 && remaining == 0);
    kvroute_flow_stats s = stats(r);
    CHECK(s.cancelled == 3 && s.dispatched == 0 && s.queued == 0 && s.releases_waiting == 0);
    kvroute_router_free(r);
}

/* ---- a buffer too small: nothing lost, nothing reordered ---- */

static void test_small_buffer(void) {
    kvroute_router *r = make(ONE_SLOT, 1);
    kvroute_admission a;
    char rid[128];
    CHECK_OK(admit(r, "t", 0, 0, &a));
    CHECK(route(r, 0, rid));
    uint64_t t[5];
    for (int i = 0; i < 5; i++) {
        CHECK_OK(admit(r, "t", 0, (uint64_t)(1 + i), &a));
        CHECK(a.kind == KVROUTE_ADMISSION_QUEUED);
        t[i] = a.ticket;
    }
    /* Turning flow control off releases everything queued (FCFS). */
    CHECK_OK(kvroute_router_reload(r, NULL, 0, NULL));
    kvroute_release rel[8];
    memset(rel, 0xAB, sizeof rel);
    unsigned char untouched[sizeof rel[0]];
    memset(untouched, 0xAB, sizeof untouched);
    size_t n = 9, remaining = 9;
    CHECK_OK(kvroute_router_take_releases(r, 10, rel, 2, &n, &remaining));
    CHECK(n == 2 && remaining == 3);
    CHECK(rel[0].ticket == t[0] && rel[1].ticket == t[1]);
    CHECK(memcmp(&rel[2], untouched, sizeof untouched) == 0); /* nothing past `cap` */
    /* The router keeps the rest: counted as waiting (not dispatched before they are taken), due
     * at once, still cancellable. */
    kvroute_flow_stats s = stats(r);
    CHECK(s.releases_waiting == 3 && s.dispatched == 2 && s.cancelled == 0);
    uint64_t deadline = 99;
    CHECK_OK(kvroute_router_next_flow_deadline(r, &deadline));
    CHECK(deadline == 0);
    char *json = dup_router_text(kvroute_router_flow_stats_json, r);
    cJSON *j = json ? cJSON_Parse(json) : NULL;
    CHECK(j != NULL);
    CHECK(cJSON_GetNumberValue(cJSON_GetObjectItemCaseSensitive(j, "releases_waiting")) == 3.0);
    cJSON_Delete(j);
    free(json);
    /* A size query: nothing taken, the count told. */
    CHECK_OK(kvroute_router_take_releases(r, 10, NULL, 0, &n, &remaining));
    CHECK(n == 0 && remaining == 3);
    bool found = false;
    CHECK_OK(kvroute_router_cancel(r, t[3], &found));
    CHECK(found);
    found = true;
    CHECK_OK(kvroute_router_cancel(r, t[3], &found));
    CHECK(!found);
    memset(rel, 0xAB, sizeof rel);
    CHECK_OK(kvroute_router_take_releases(r, 11, rel, 1, &n, &remaining));
    CHECK(n == 1 && remaining == 1 && rel[0].ticket == t[2]);
    CHECK(memcmp(&rel[1], untouched, sizeof untouched) == 0);
    CHECK_OK(kvroute_router_take_releases(r, 11, rel, 8, &n, &remaining));
    CHECK(n == 1 && remaining == 0 && rel[0].ticket == t[4] && rel[0].outcome == KVROUTE_RELEASE_DISPATCHED);
    CHECK_CODE(kvroute_router_next_flow_deadline(r, &deadline), KVROUTE_RESULT_ABSENT);
    s = stats(r);
    CHECK(s.releases_waiting == 0 && s.dispatched == 4 && s.cancelled == 1 && s.enqueued == 5);
    /* The router's stats JSON counts the same way. */
    json = dup_router_text(kvroute_router_stats_json, r);
    j = json ? cJSON_Parse(json) : NULL;
    const cJSON *counters = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(j, "flow"), "counters");
    CHECK(cJSON_GetNumberValue(cJSON_GetObjectItemCaseSensitive(counters, "dispatched")) == 4.0);
    CHECK(cJSON_GetNumberValue(cJSON_GetObjectItemCaseSensitive(counters, "cancelled")) == 1.0);
    cJSON_Delete(j);
    free(json);
    CHECK_OK(kvroute_router_complete(r, rid));
    kvroute_router_free(r);
}

/* ---- NULL and invalid arguments: typed codes, out-parameters unwritten, nothing lost ---- */

static void last_error_names(const char *function) {
    char msg[512];
    g_checks++;
    if (kvroute_last_error_message(msg, sizeof msg, NULL) != KVROUTE_RESULT_OK ||
        strncmp(msg, function, strlen(function)) != 0) {
        g_failures++;
        fprintf(stderr, "last error \"%s\" does not start with %s\n", msg, function);
    }
}

static void test_bad_arguments(void) {
    kvroute_router *r = make(ONE_SLOT, 1);
    kvroute_admission a, untouched_a;
    memset(&untouched_a, 0xAB, sizeof untouched_a);
    memcpy(&a, &untouched_a, sizeof a);
    kvroute_header h[1];
    set_header(&h[0], "x-llm-d-inference-fairness-id", "t");

    CHECK_CODE(kvroute_router_admit(NULL, BODY, strlen(BODY), h, 1, 0, &a), KVROUTE_RESULT_NULL_ARGUMENT);
    last_error_names("kvroute_router_admit");
    CHECK_CODE(kvroute_router_admit(r, BODY, strlen(BODY), h, 1, 0, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_admit(r, NULL, 5, h, 1, 0, &a), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_admit(r, BODY, strlen(BODY), NULL, 1, 0, &a), KVROUTE_RESULT_NULL_ARGUMENT);
    /* A malformed body: a request error naming the field; a bad header value: naming the header. */
    const char *bad_body = "{\"prompt\":\"hello\"}";
    CHECK_CODE(kvroute_router_admit(r, bad_body, strlen(bad_body), NULL, 0, 0, &a), KVROUTE_RESULT_REQUEST_ERROR);
    char got[128];
    CHECK_OK(kvroute_last_error_field(got, sizeof got, NULL));
    CHECK_STR(got, "model");
    kvroute_header bad[1];
    set_header(&bad[0], "x-kvroute-priority", "high");
    CHECK_CODE(kvroute_router_admit(r, BODY, strlen(BODY), bad, 1, 0, &a), KVROUTE_RESULT_REQUEST_ERROR);
    CHECK_OK(kvroute_last_error_header(got, sizeof got, NULL));
    CHECK_STR(got, "x-kvroute-priority");
    const char bad_utf8[] = {'t', (char)0xff};
    kvroute_header inv[1] = {{"x-llm-d-inference-fairness-id", 29, bad_utf8, 2}};
    CHECK_CODE(kvroute_router_admit(r, BODY, strlen(BODY), inv, 1, 0, &a), KVROUTE_RESULT_INVALID_UTF8);
    const char bad_body_utf8[] = {'{', (char)0xc3, '}'};
    CHECK_CODE(kvroute_router_admit(r, bad_body_utf8, 3, NULL, 0, 0, &a), KVROUTE_RESULT_REQUEST_ERROR);
    CHECK(memcmp(&a, &untouched_a, sizeof a) == 0);
    /* None of these admitted or queued anything. */
    kvroute_flow_stats s = stats(r);
    CHECK(s.admitted == 0 && s.enqueued == 0);

    /* Queue one so that failed takes have something to lose. */
    char rid[128];
    CHECK_OK(kvroute_router_admit(r, BODY, strlen(BODY), h, 1, 0, &a));
    CHECK(a.kind == KVROUTE_ADMISSION_ADMIT);
    CHECK(route(r, 0, rid));
    CHECK_OK(kvroute_router_admit(r, BODY, strlen(BODY), h, 1, 1, &a));
    CHECK(a.kind == KVROUTE_ADMISSION_QUEUED);
    CHECK_OK(kvroute_router_complete(r, rid));
    kvroute_release rel[2];
    size_t n = 77, remaining = 77;
    CHECK_CODE(kvroute_router_take_releases(NULL, 5, rel, 2, &n, &remaining), KVROUTE_RESULT_NULL_ARGUMENT);
    last_error_names("kvroute_router_take_releases");
    CHECK_CODE(kvroute_router_take_releases(r, 5, rel, 2, NULL, &remaining), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_take_releases(r, 5, rel, 2, &n, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_take_releases(r, 5, NULL, 2, &n, &remaining), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK(n == 77 && remaining == 77);
    CHECK_OK(kvroute_router_take_releases(r, 5, rel, 2, &n, &remaining));
    CHECK(n == 1 && remaining == 0 && rel[0].ticket == a.ticket && rel[0].outcome == KVROUTE_RELEASE_DISPATCHED);
    CHECK(route(r, 5, rid));
    CHECK_OK(kvroute_router_complete(r, rid));

    bool found = true;
    CHECK_CODE(kvroute_router_cancel(NULL, a.ticket, &found), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK(found);
    CHECK_CODE(kvroute_router_flow_tick(NULL, 0), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_shutdown_queue(NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    uint64_t deadline = 5;
    CHECK_CODE(kvroute_router_next_flow_deadline(NULL, &deadline), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_next_flow_deadline(r, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK(deadline == 5);
    kvroute_flow_stats st;
    CHECK_CODE(kvroute_router_flow_stats(NULL, &st), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_flow_stats(r, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    kvroute_flow_saturation sat;
    CHECK_CODE(kvroute_router_flow_saturation(NULL, 0, &sat), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_flow_saturation(r, 0, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_flow_stats_json(NULL, NULL, 0, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_flow_stats_json(r, NULL, 8, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    char small[4] = "###";
    size_t need = 0;
    CHECK_CODE(kvroute_router_flow_stats_json(r, small, sizeof small, &need), KVROUTE_RESULT_BUFFER_TOO_SMALL);
    CHECK(need > sizeof small && strcmp(small, "###") == 0);

    /* Bands: a size query, a too-small buffer (untouched), then the copy. */
    kvroute_flow_band bands[2], untouched_b;
    memset(bands, 0xAB, sizeof bands);
    memset(&untouched_b, 0xAB, sizeof untouched_b);
    size_t count = 0;
    CHECK_CODE(kvroute_router_flow_bands(NULL, bands, 2, &count), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_flow_bands(r, bands, 2, NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_flow_bands(r, NULL, 2, &count), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK(count == 0);
    kvroute_router *banded = make(
        "{\"flow_control\":{\"enabled\":true,\"priority_holdback\":0.25,\"priority_bands\":[{\"priority\":10},"
        "{\"priority\":0},{\"priority\":-1}]}}",
        1);
    CHECK_CODE(kvroute_router_flow_bands(banded, NULL, 0, &count), KVROUTE_RESULT_BUFFER_TOO_SMALL);
    CHECK(count == 3);
    count = 0;
    CHECK_CODE(kvroute_router_flow_bands(banded, bands, 2, &count), KVROUTE_RESULT_BUFFER_TOO_SMALL);
    CHECK(count == 3 && memcmp(&bands[0], &untouched_b, sizeof untouched_b) == 0);
    kvroute_flow_band all[64];
    CHECK_OK(kvroute_router_flow_bands(banded, all, 64, &count));
    CHECK(count == 3 && all[0].priority == 10 && all[1].priority == 0 && all[2].priority == -1);
    CHECK(all[0].ceiling == 1.0 && all[1].ceiling == 0.75 && all[2].ceiling == 0.5);
    CHECK(stats(banded).bands == 3);
    kvroute_router_free(banded);
    kvroute_router_free(r);
}

/* ---- a seeded random sequence: every ticket ends exactly once ---- */

static uint64_t g_rng;

static uint64_t rnd(void) { /* xorshift64* */
    g_rng ^= g_rng >> 12;
    g_rng ^= g_rng << 25;
    g_rng ^= g_rng >> 27;
    return g_rng * 2685821657736338717ull;
}

static unsigned below(unsigned n) {
    return (unsigned)(rnd() % n);
}

typedef struct {
    uint64_t ticket;
    int ended; /* times ended: must end at exactly 1 */
} ticket_state;

static const char *RANDOM_POLICIES[3] = {
    "{\"flow_control\":{\"enabled\":true,\"max_requests\":12,\"default_request_ttl_ms\":40,"
    "\"no_endpoints_ttl_ms\":20,\"saturation_detector\":{\"kind\":\"concurrency\",\"max_requests_per_endpoint\":2},"
    "\"priority_bands\":[{\"priority\":5},{\"priority\":0,\"max_requests\":6},"
    "{\"priority\":-1,\"fairness_policy\":\"attained_service\"}],"
    "\"shedding\":{\"enabled\":true,\"k\":0.5,\"power\":2.0,\"seed\":7}}}",
    /* lower limits: reloads evict (evicted-queue-pressure) */
    "{\"flow_control\":{\"enabled\":true,\"max_requests\":3,\"default_request_ttl_ms\":25,"
    "\"saturation_detector\":{\"kind\":\"concurrency\",\"max_requests_per_endpoint\":1},"
    "\"default_priority_band\":{\"ordering_policy\":\"edf\"}}}",
    /* off: everything queued is released */
    "{}",
};

static void test_random(uint64_t seed, int steps) {
    g_rng = seed * 0x9E3779B97F4A7C15ull + 1;
    kvroute_router *r = make(RANDOM_POLICIES[0], 2);
    int policy = 0;
    size_t cap_t = 64, nt = 0;
    ticket_state *tickets = malloc(cap_t * sizeof *tickets);
    char(*inflight)[128] = malloc(4096 * sizeof *inflight);
    size_t ninflight = 0;
    uint64_t now = 0;
    uint64_t admitted = 0, rejected[7] = {0}, dispatched = 0, cancelled = 0;
    bool healthy[2] = {true, true};
    const char *tenants[4] = {"a", "b", "c", "d"};
    const int prios[4] = {5, 0, 0, -1};
    kvroute_release buf[6];
    unsigned char untouched[sizeof buf[0]];
    memset(untouched, 0xAB, sizeof untouched);
    int failures_before = g_failures;

#define FIND_TICKET(t, out)                                      \
    do {                                                         \
        out = NULL;                                              \
        for (size_t k_ = 0; k_ < nt; k_++) {                     \
            if (tickets[k_].ticket == (t)) out = &tickets[k_];   \
        }                                                        \
    } while (0)

    for (int step = 0; step < steps && g_failures == failures_before; step++) {
        now += below(6);
        unsigned op = below(100);
        if (op < 35) {
            kvroute_admission a;
            CHECK_OK(admit(r, tenants[below(4)], prios[below(4)], now, &a));
            if (a.kind == KVROUTE_ADMISSION_ADMIT) {
                if (policy != 2) admitted++;
                if (ninflight < 4096 && route(r, now, inflight[ninflight])) ninflight++;
            } else if (a.kind == KVROUTE_ADMISSION_QUEUED) {
                ticket_state *t;
                FIND_TICKET(a.ticket, t);
                CHECK(t == NULL); /* tickets are never reused */
                if (nt == cap_t) tickets = realloc(tickets, (cap_t *= 2) * sizeof *tickets);
                tickets[nt].ticket = a.ticket;
                tickets[nt].ended = 0;
                nt++;
            } else {
                CHECK(a.kind == KVROUTE_ADMISSION_REJECTED && a.rejection.reason >= 1 && a.rejection.reason <= 6);
                CHECK(a.rejection.status == (a.rejection.reason == 3 || a.rejection.reason == 4 ? 503 : 429));
                if (a.rejection.reason <= 6) rejected[a.rejection.reason]++;
            }
        } else if (op < 55) {
            size_t cap = below(5), n = 99, remaining = 99;
            memset(buf, 0xAB, sizeof buf);
            CHECK_OK(kvroute_router_take_releases(r, now, cap ? buf : NULL, cap, &n, &remaining));
            CHECK(n <= cap && (remaining == 0 || n == cap));
            CHECK(memcmp(&buf[n], untouched, sizeof untouched) == 0);
            for (size_t i = 0; i < n; i++) {
                ticket_state *t;
                FIND_TICKET(buf[i].ticket, t);
                g_checks++;
                if (t == NULL || t->ended != 0) {
                    g_failures++;
                    fprintf(stderr, "random %" PRIu64 " step %d: release of ticket %" PRIu64 " %s\n", seed, step,
                            buf[i].ticket, t ? "that already ended" : "never issued");
                    continue;
                }
                t->ended++;
                if (buf[i].outcome == KVROUTE_RELEASE_DISPATCHED) {
                    dispatched++;
                    CHECK(buf[i].rejection.status == 0 && buf[i].rejection.reason_name == NULL);
                    if (ninflight < 4096 && route(r, now, inflight[ninflight])) ninflight++;
                } else {
                    kvroute_drop_reason k = buf[i].rejection.reason;
                    CHECK(buf[i].outcome == KVROUTE_RELEASE_DROPPED && k >= 1 && k <= 6);
                    CHECK(buf[i].rejection.status == (k == 3 || k == 4 ? 503 : 429));
                    CHECK_STR(buf[i].rejection.reason_name, kvroute_drop_reason_name(k));
                    if (k <= 6) rejected[k]++;
                }
            }
        } else if (op < 72) {
            if (ninflight > 0) {
                size_t i = below((unsigned)ninflight);
                CHECK_OK(kvroute_router_complete(r, inflight[i]));
                memcpy(inflight[i], inflight[--ninflight], 128);
            }
        } else if (op < 85) {
            if (nt == 0) continue;
            ticket_state *t = &tickets[below((unsigned)nt)];
            bool found = !t->ended;
            CHECK_OK(kvroute_router_cancel(r, below(10) == 0 ? 0 : t->ticket, &found));
            if (found) {
                /* Held (queued, or released and not taken) until taken: a ticket not seen
                 * ending is always found. */
                g_checks++;
                if (t->ended) {
                    g_failures++;
                    fprintf(stderr, "random %" PRIu64 " step %d: cancel found an ended ticket\n", seed, step);
                }
                t->ended++;
                cancelled++;
            }
        } else if (op < 90) {
            CHECK_OK(kvroute_router_flow_tick(r, now));
        } else if (op < 93) {
            int e = (int)below(2);
            healthy[e] = !healthy[e];
            CHECK_OK(kvroute_router_set_healthy(r, e ? EP2 : EP1, healthy[e]));
        } else if (op < 95) {
            policy = (int)below(3);
            const char *p = RANDOM_POLICIES[policy];
            CHECK_OK(kvroute_router_reload(r, p, strlen(p), NULL));
        } else {
            uint64_t d;
            kvroute_result res = kvroute_router_next_flow_deadline(r, &d);
            CHECK(res == KVROUTE_RESULT_OK || res == KVROUTE_RESULT_ABSENT);
            kvroute_flow_stats s = stats(r);
            CHECK(s.bands <= 64);
        }
        /* Cancelling a ticket that ended must find nothing. */
        if (nt > 0 && below(4) == 0) {
            ticket_state *t = &tickets[below((unsigned)nt)];
            if (t->ended) {
                bool found = true;
                CHECK_OK(kvroute_router_cancel(r, t->ticket, &found));
                CHECK(!found);
            }
        }
    }
    /* Shut down and take everything: every ticket has ended exactly once. */
    CHECK_OK(kvroute_router_shutdown_queue(r));
    size_t remaining = 0;
    do {
        size_t n = 0;
        CHECK_OK(kvroute_router_take_releases(r, now, buf, 3, &n, &remaining));
        for (size_t i = 0; i < n; i++) {
            ticket_state *t;
            FIND_TICKET(buf[i].ticket, t);
            CHECK(t != NULL && t->ended == 0);
            if (t) t->ended++;
            if (buf[i].outcome == KVROUTE_RELEASE_DISPATCHED) {
                dispatched++;
            } else {
                CHECK(buf[i].rejection.reason == KVROUTE_DROP_REASON_REJECTED_SHUTTING_DOWN ||
                      buf[i].rejection.reason <= 6);
                if (buf[i].rejection.reason <= 6) rejected[buf[i].rejection.reason]++;
            }
        }
    } while (remaining > 0);
    size_t not_once = 0;
    for (size_t k = 0; k < nt; k++) not_once += tickets[k].ended != 1;
    g_checks++;
    if (not_once) {
        g_failures++;
        fprintf(stderr, "random %" PRIu64 ": %zu of %zu tickets did not end exactly once\n", seed, not_once, nt);
    }
    kvroute_flow_stats s = stats(r);
    CHECK(s.queued == 0 && s.releases_waiting == 0 && s.enqueued == nt);
    CHECK(s.admitted == admitted && s.dispatched == dispatched && s.cancelled == cancelled);
    for (int k = 1; k <= 6; k++) {
        g_checks++;
        if (s.rejections[k] != rejected[k]) {
            g_failures++;
            fprintf(stderr, "random %" PRIu64 ": %s: stats %" PRIu64 ", seen %" PRIu64 "\n", seed,
                    kvroute_drop_reason_name((kvroute_drop_reason)k), s.rejections[k], rejected[k]);
        }
    }
    printf("flow: random seed %" PRIu64 ": %d steps, %zu tickets (%" PRIu64 " dispatched, %" PRIu64
           " cancelled), %" PRIu64 " admitted at once; rejections by reason 1-6: %" PRIu64 " %" PRIu64 " %" PRIu64
           " %" PRIu64 " %" PRIu64 " %" PRIu64 "\n",
           seed, steps, nt, dispatched, cancelled, admitted, rejected[1], rejected[2], rejected[3], rejected[4],
           rejected[5], rejected[6]);
    for (size_t i = 0; i < ninflight; i++) CHECK_OK(kvroute_router_complete(r, inflight[i]));
    free(inflight);
    free(tickets);
    kvroute_router_free(r);
#undef FIND_TICKET
}

/* ---- threads: one router, admissions, takes, cancels and completions from every thread ---- */

enum { THREADS = 4 };

static struct {
    kvroute_router *r;
    pthread_mutex_t lock;
    struct tstate {
        uint64_t ticket;
        int issued; /* the admitting thread has recorded it */
        int ended;  /* times ended */
    } *t;
    size_t n, cap;
    atomic_uint_fast64_t clock;
    atomic_int done;
    int iterations;
    atomic_int errors;
} g;

/* The record of ticket `t` (created if absent: a release can be taken by another thread before
 * the admitting thread records its ticket). Tickets are never reused. Call with the lock held. */
static struct tstate *record(uint64_t t) {
    for (size_t i = 0; i < g.n; i++) {
        if (g.t[i].ticket == t) return &g.t[i];
    }
    if (g.n == g.cap) g.t = realloc(g.t, (g.cap = g.cap ? 2 * g.cap : 256) * sizeof *g.t);
    g.t[g.n].ticket = t;
    g.t[g.n].issued = 0;
    g.t[g.n].ended = 0;
    return &g.t[g.n++];
}

static void ended(uint64_t t) {
    pthread_mutex_lock(&g.lock);
    struct tstate *s = record(t);
    if (s->ended++) atomic_fetch_add(&g.errors, 1);
    pthread_mutex_unlock(&g.lock);
}

static void *worker(void *arg) {
    uint64_t seed = (uint64_t)(uintptr_t)arg * 7919 + 3;
    char (*mine)[128] = malloc(256 * sizeof *mine);
    size_t nmine = 0;
    kvroute_release buf[2];
    for (int i = 0; i < g.iterations; i++) {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        uint64_t now = atomic_fetch_add(&g.clock, 1);
        const char *tenant = (seed & 1) ? "x" : "y";
        kvroute_admission a;
        if (admit(g.r, tenant, (seed & 6) == 6 ? -1 : 0, now, &a) != KVROUTE_RESULT_OK) atomic_fetch_add(&g.errors, 1);
        if (a.kind == KVROUTE_ADMISSION_ADMIT) {
            if (nmine < 256 && route(g.r, now, mine[nmine])) nmine++;
        } else if (a.kind == KVROUTE_ADMISSION_QUEUED) {
            pthread_mutex_lock(&g.lock);
            struct tstate *s = record(a.ticket);
            if (s->issued) atomic_fetch_add(&g.errors, 1); /* a live ticket issued twice */
            s->issued = 1;
            pthread_mutex_unlock(&g.lock);
            if ((seed & 24) == 24) {
                bool found = false;
                kvroute_router_cancel(g.r, a.ticket, &found);
                if (found) ended(a.ticket);
            }
        }
        if (nmine > 0 && (seed & 96) != 0) {
            if (kvroute_router_complete(g.r, mine[--nmine]) != KVROUTE_RESULT_OK) atomic_fetch_add(&g.errors, 1);
        }
        size_t n = 0, remaining = 0;
        if (kvroute_router_take_releases(g.r, now, buf, 2, &n, &remaining) != KVROUTE_RESULT_OK) {
            atomic_fetch_add(&g.errors, 1);
        }
        for (size_t k = 0; k < n; k++) {
            ended(buf[k].ticket);
            if (buf[k].outcome == KVROUTE_RELEASE_DISPATCHED && nmine < 256 && route(g.r, now, mine[nmine])) nmine++;
        }
    }
    while (nmine > 0) {
        if (kvroute_router_complete(g.r, mine[--nmine]) != KVROUTE_RESULT_OK) atomic_fetch_add(&g.errors, 1);
    }
    free(mine);
    return NULL;
}

static void *reader(void *arg) {
    (void)arg;
    while (!atomic_load(&g.done)) {
        kvroute_flow_stats s;
        kvroute_flow_band bands[64];
        size_t count = 0;
        uint64_t d = 0;
        if (kvroute_router_flow_stats(g.r, &s) != KVROUTE_RESULT_OK) atomic_fetch_add(&g.errors, 1);
        if (kvroute_router_flow_bands(g.r, bands, 64, &count) != KVROUTE_RESULT_OK) atomic_fetch_add(&g.errors, 1);
        kvroute_result res = kvroute_router_next_flow_deadline(g.r, &d);
        if (res != KVROUTE_RESULT_OK && res != KVROUTE_RESULT_ABSENT) atomic_fetch_add(&g.errors, 1);
        char *json = dup_router_text(kvroute_router_flow_stats_json, g.r);
        if (json == NULL) atomic_fetch_add(&g.errors, 1);
        free(json);
        /* Let the workers at the router's locks between reads: under valgrind, which runs one
         * thread at a time, a reader that never yields can keep retaking the locks the workers
         * wait for, and on a loaded machine the test then ran past its time limit. */
        sched_yield();
    }
    return NULL;
}

static void test_threads(int iterations) {
    memset(&g, 0, sizeof g);
    pthread_mutex_init(&g.lock, NULL);
    g.iterations = iterations;
    g.r = make(
        "{\"flow_control\":{\"enabled\":true,\"max_requests\":16,\"default_request_ttl_ms\":30,"
        "\"saturation_detector\":{\"kind\":\"concurrency\",\"max_requests_per_endpoint\":2}}}",
        2);
    pthread_t th[THREADS], rd;
    for (int i = 0; i < THREADS; i++) pthread_create(&th[i], NULL, worker, (void *)(uintptr_t)(i + 1));
    pthread_create(&rd, NULL, reader, NULL);
    for (int i = 0; i < THREADS; i++) pthread_join(th[i], NULL);
    atomic_store(&g.done, 1);
    pthread_join(rd, NULL);
    CHECK_OK(kvroute_router_shutdown_queue(g.r));
    kvroute_release buf[4];
    size_t remaining = 0;
    do {
        size_t n = 0;
        CHECK_OK(kvroute_router_take_releases(g.r, atomic_load(&g.clock), buf, 4, &n, &remaining));
        for (size_t k = 0; k < n; k++) ended(buf[k].ticket);
    } while (remaining > 0);
    size_t bad = 0;
    for (size_t i = 0; i < g.n; i++) bad += !(g.t[i].issued && g.t[i].ended == 1);
    CHECK(atomic_load(&g.errors) == 0);
    g_checks++;
    if (bad) {
        g_failures++;
        fprintf(stderr, "threads: %zu of %zu tickets did not end exactly once\n", bad, g.n);
    }
    kvroute_flow_stats s = stats(g.r);
    CHECK(s.enqueued == g.n && s.queued == 0 && s.releases_waiting == 0);
    printf("flow: %d threads x %d iterations, %zu tickets checked to end exactly once\n", THREADS, iterations, g.n);
    free(g.t);
    pthread_mutex_destroy(&g.lock);
    kvroute_router_free(g.r);
}

int main(int argc, char **argv) {
    int scale = argc > 1 ? atoi(argv[1]) : 200;
    if (scale < 1) scale = 1;
    test_names();
    test_off();
    test_queued_released_by_completion();
    test_rejections();
    test_cancel();
    test_small_buffer();
    test_bad_arguments();
    for (uint64_t seed = 1; seed <= 3; seed++) test_random(seed, 20 * scale);
    test_threads(scale);
    return finish("flow");
}
