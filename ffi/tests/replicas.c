/* Router replicas through the C API (`kvroute_router_replicate`, `kvroute_replication_*`), over a
 * real nats-server on loopback that scripts/test-ffi.sh starts (JetStream, temporary storage,
 * token authentication) and names in KVROUTE_NATS_URL and KVROUTE_NATS_TOKEN. Two routers
 * replicate: a request routed on A is in flight on B, the same prompt on B goes where A sent it
 * with a prefix hit, A's completion reaches B; a replica with a wrong token never connects and
 * is never applied; NULL arguments and bad options return their codes. Every wait is bounded
 * (argv[1] seconds, default 30: valgrind serializes the replication threads); no timing is
 * asserted. Skipped (passes) only when the library was built without the `nats` feature. */
#define _POSIX_C_SOURCE 200809L
#include <stdbool.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common.h"

static const char *EPS[] = {"10.0.2.1:8000", "10.0.2.2:8000", "10.0.2.3:8000", "10.0.2.4:8000"};
static double g_wait_s = 30.0;
/* Fleet names of this process: the ASan and the valgrind runs share one server, whose streams
 * (one per fleet) they must not replay to each other. */
static char g_fleet_c[32], g_fleet_w[32];

static double seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static kvroute_router *new_router(void) {
    kvroute_router *r = NULL;
    CHECK_OK(kvroute_router_new(NULL, 0, &r));
    for (size_t i = 0; r != NULL && i < sizeof EPS / sizeof EPS[0]; i++) {
        CHECK_OK(kvroute_router_upsert_endpoint(r, EPS[i], KVROUTE_ROLE_DECODE));
    }
    return r;
}

static kvroute_result replicate(const kvroute_router *r, const char *json, kvroute_replication **out) {
    return kvroute_router_replicate(r, json, strlen(json), out);
}

/* The replication's stats, parsed (cJSON_Delete it); NULL on failure. */
static cJSON *stats_of(const kvroute_replication *rep) {
    size_t need = 0;
    if (kvroute_replication_stats_json(rep, NULL, 0, &need) != KVROUTE_RESULT_BUFFER_TOO_SMALL) return NULL;
    for (;;) {
        char *s = malloc(need);
        if (s == NULL) return NULL;
        kvroute_result res = kvroute_replication_stats_json(rep, s, need, &need);
        if (res == KVROUTE_RESULT_OK) {
            cJSON *j = cJSON_Parse(s);
            free(s);
            return j;
        }
        free(s);
        if (res != KVROUTE_RESULT_BUFFER_TOO_SMALL) return NULL;
    }
}

/* A number at `path` ("received" or "replica.effects_applied") of the stats; -1 when absent. */
static double stat_num(const kvroute_replication *rep, const char *field, const char *sub) {
    cJSON *j = stats_of(rep);
    const cJSON *v = j ? cJSON_GetObjectItemCaseSensitive(j, field) : NULL;
    if (v != NULL && sub != NULL) v = cJSON_GetObjectItemCaseSensitive(v, sub);
    double out = -1;
    if (cJSON_IsNumber(v)) out = v->valuedouble;
    if (cJSON_IsBool(v)) out = cJSON_IsTrue(v) ? 1 : 0;
    cJSON_Delete(j);
    return out;
}

/* Whether the stats' last_error mentions `needle`. */
static bool last_error_has(const kvroute_replication *rep, const char *needle) {
    cJSON *j = stats_of(rep);
    const cJSON *v = j ? cJSON_GetObjectItemCaseSensitive(j, "last_error") : NULL;
    bool has = cJSON_IsString(v) && strstr(v->valuestring, needle) != NULL;
    cJSON_Delete(j);
    return has;
}

static uint64_t inflight(const kvroute_router *r) {
    kvroute_stats s;
    memset(&s, 0, sizeof s);
    CHECK_OK(kvroute_router_stats(r, &s));
    return s.inflight_requests;
}

/* Poll `cond` every 10 ms for at most g_wait_s seconds; CHECK that it held. */
#define WAIT_UNTIL(cond)                                \
    do {                                                \
        double until_ = seconds() + g_wait_s;           \
        while (!(cond) && seconds() < until_) {         \
            sleep_ms(10);                               \
        }                                               \
        CHECK(cond);                                    \
    } while (0)

static char g_body[1024];

static const char *body(int tenant) {
    int n = snprintf(g_body, sizeof g_body, "{\"model\":\"m\",\"prompt\":\"");
    for (int i = 0; i < 40; i++) n += snprintf(g_body + n, sizeof g_body - (size_t)n, "system prompt ");
    snprintf(g_body + n, sizeof g_body - (size_t)n,
             "tenant %d asks a long question about caches\",\"max_tokens\":8}", tenant);
    return g_body;
}

static kvroute_decision *route(const kvroute_router *r, int tenant, const char *request_id) {
    kvroute_header h = {"x-request-id", 12, request_id, strlen(request_id)};
    const char *b = body(tenant);
    kvroute_decision *d = NULL;
    CHECK_OK(kvroute_router_route(r, b, strlen(b), &h, 1, kvroute_now_ms(), &d));
    return d;
}

static void field_is(const char *want) {
    char field[128] = {0};
    CHECK_OK(kvroute_last_error_field(field, sizeof field, NULL));
    CHECK_STR(field, want);
}

static void bad_arguments(void) {
    kvroute_router *r = new_router();
    kvroute_replication *rep = NULL;
    const char *ok = "{\"replica_id\": \"x\"}";
    CHECK_CODE(kvroute_router_replicate(NULL, ok, strlen(ok), &rep), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_replicate(r, ok, strlen(ok), NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_replicate(r, NULL, 5, &rep), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_router_replicate(r, NULL, 0, &rep), KVROUTE_RESULT_CONFIG_ERROR);
    CHECK_CODE(replicate(r, "{not json", &rep), KVROUTE_RESULT_CONFIG_ERROR);
    field_is("options");
    CHECK_CODE(replicate(r, "{\"replica_id\": \"x\", \"nope\": 1}", &rep), KVROUTE_RESULT_CONFIG_ERROR);
    field_is("options");
    CHECK_CODE(replicate(r, "{\"replica_id\": 5}", &rep), KVROUTE_RESULT_CONFIG_ERROR);
    CHECK_CODE(replicate(r, "[]", &rep), KVROUTE_RESULT_CONFIG_ERROR);
    CHECK_CODE(replicate(r, "{}", &rep), KVROUTE_RESULT_CONFIG_ERROR);
    field_is("replica_id");
    CHECK_CODE(replicate(r, "{\"replica_id\": \"has space\"}", &rep), KVROUTE_RESULT_CONFIG_ERROR);
    field_is("replica_id");
    CHECK_CODE(replicate(r, "{\"replica_id\": \"x\", \"flush_interval_ms\": 0}", &rep), KVROUTE_RESULT_CONFIG_ERROR);
    field_is("flush_interval_ms");
    CHECK_CODE(replicate(r, "{\"replica_id\": \"x\", \"password\": \"p\"}", &rep), KVROUTE_RESULT_CONFIG_ERROR);
    field_is("password");
    const char bad_utf8[] = "{\"replica_id\": \"\xff\"}";
    CHECK_CODE(kvroute_router_replicate(r, bad_utf8, sizeof bad_utf8 - 1, &rep), KVROUTE_RESULT_INVALID_UTF8);
    CHECK(rep == NULL); /* out-parameters are written only on success */
    char msg[256];
    CHECK_OK(kvroute_last_error_message(msg, sizeof msg, NULL));
    CHECK(strncmp(msg, "kvroute_router_replicate: ", 26) == 0);

    /* NULL handles */
    size_t need = 0;
    char buf[8];
    CHECK_CODE(kvroute_replication_stats_json(NULL, buf, sizeof buf, &need), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_replication_flush(NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK_CODE(kvroute_replication_stop(NULL), KVROUTE_RESULT_NULL_ARGUMENT);
    CHECK(!kvroute_replication_is_running(NULL));
    kvroute_replication_free(NULL);
    CHECK_CODE(kvroute_router_replica_stats_json(NULL, buf, sizeof buf, &need), KVROUTE_RESULT_NULL_ARGUMENT);
    /* not replicating: no replica stats */
    CHECK_CODE(kvroute_router_replica_stats_json(r, buf, sizeof buf, &need), KVROUTE_RESULT_ABSENT);
    CHECK_STR(kvroute_result_name(KVROUTE_RESULT_REPLICATION_ERROR), "KVROUTE_RESULT_REPLICATION_ERROR");
    kvroute_router_free(r);
}

static void two_replicas(const char *url, const char *token) {
    char opts[512];
    kvroute_router *a = new_router(), *b = new_router();
    kvroute_replication *ra = NULL, *rb = NULL;
    snprintf(opts, sizeof opts, "{\"url\": \"%s\", \"fleet\": \"%s\", \"replica_id\": \"a\", \"token\": \"%s\"}",
             url, g_fleet_c, token);
    CHECK_OK(replicate(a, opts, &ra));
    snprintf(opts, sizeof opts, "{\"url\": \"%s\", \"fleet\": \"%s\", \"replica_id\": \"b\", \"token\": \"%s\"}",
             url, g_fleet_c, token);
    CHECK_OK(replicate(b, opts, &rb));
    if (ra == NULL || rb == NULL) {
        kvroute_replication_free(ra);
        kvroute_replication_free(rb);
        kvroute_router_free(a);
        kvroute_router_free(b);
        return;
    }
    CHECK(kvroute_replication_is_running(ra));
    /* one replication per router at a time */
    kvroute_replication *again = NULL;
    CHECK_CODE(replicate(a, opts, &again), KVROUTE_RESULT_STATE_ERROR);
    CHECK(again == NULL);

    WAIT_UNTIL(stat_num(ra, "connected", NULL) == 1 && stat_num(rb, "inbound_ready", NULL) == 1);
    kvroute_decision *d = route(a, 1, "r1");
    CHECK_OK(kvroute_replication_flush(ra));
    WAIT_UNTIL(inflight(b) == 1);
    kvroute_decision *d2 = route(b, 1, "r2");
    char e1[64] = {0}, e2[64] = {0}, id[128] = {0};
    if (d != NULL && d2 != NULL) {
        CHECK_OK(kvroute_decision_endpoint(d, e1, sizeof e1, NULL));
        CHECK_OK(kvroute_decision_endpoint(d2, e2, sizeof e2, NULL));
        CHECK_STR(e2, e1); /* b routes the prompt where a sent it ... */
        CHECK(kvroute_decision_prefix_hit(d2) > 0.5); /* ... for its prefix */
        CHECK_OK(kvroute_decision_request_id(d, id, sizeof id, NULL));
        CHECK_OK(kvroute_router_complete(a, id));
    }
    /* a's completion reaches b (b's own request stays), b's request reaches a */
    WAIT_UNTIL(inflight(b) == 1 && inflight(a) == 1 && stat_num(rb, "replica", "completions_applied") == 1);
    CHECK(stat_num(rb, "replica", "effects_applied") >= 1);
    CHECK(stat_num(rb, "replica", "malformed") == 0);
    CHECK(stat_num(rb, "publish_errors", NULL) == 0);

    /* strings out: a size query, a buffer too small left untouched */
    size_t need = 0;
    char small[4] = "abc";
    CHECK_CODE(kvroute_replication_stats_json(rb, small, sizeof small, &need), KVROUTE_RESULT_BUFFER_TOO_SMALL);
    CHECK(need > sizeof small && strcmp(small, "abc") == 0);
    char *rs = dup_router_text(kvroute_router_replica_stats_json, b);
    CHECK(rs != NULL && strstr(rs, "\"replica_id\":\"b\"") != NULL);
    free(rs);

    /* stop twice, flush after the stop: no-ops; the router routes on, replication off */
    CHECK_OK(kvroute_replication_stop(ra));
    CHECK_OK(kvroute_replication_stop(ra));
    CHECK_OK(kvroute_replication_flush(ra));
    CHECK(!kvroute_replication_is_running(ra));
    CHECK(stat_num(ra, "connected", NULL) == 0);
    CHECK_CODE(kvroute_router_replica_stats_json(a, small, sizeof small, &need), KVROUTE_RESULT_ABSENT);
    kvroute_decision *d3 = route(a, 2, "r3");
    CHECK(d3 != NULL);
    kvroute_decision_free(d3);

    kvroute_decision_free(d);
    kvroute_decision_free(d2);
    kvroute_replication_free(ra);
    /* freed while running: stops it; the router handle may go first */
    kvroute_router_free(b);
    kvroute_replication_free(rb);
    kvroute_router_free(a);
}

static void wrong_token(const char *url, const char *token) {
    char opts[512];
    kvroute_router *good = new_router(), *bad = new_router();
    kvroute_replication *rg = NULL, *rbad = NULL;
    snprintf(opts, sizeof opts, "{\"url\": \"%s\", \"fleet\": \"%s\", \"replica_id\": \"good\", \"token\": \"%s\"}",
             url, g_fleet_w, token);
    CHECK_OK(replicate(good, opts, &rg));
    snprintf(opts, sizeof opts, "{\"url\": \"%s\", \"fleet\": \"%s\", \"replica_id\": \"bad\", \"token\": \"wrong\"}",
             url, g_fleet_w);
    CHECK_OK(replicate(bad, opts, &rbad)); /* refused credentials are no error: the thread keeps trying */
    if (rg != NULL && rbad != NULL) {
        WAIT_UNTIL(stat_num(rg, "inbound_ready", NULL) == 1);
        WAIT_UNTIL(stat_num(rbad, "server_errors", NULL) > 0 || last_error_has(rbad, "uthorization"));
        for (int i = 0; i < 3; i++) {
            char rid[16];
            snprintf(rid, sizeof rid, "bad-%d", i);
            kvroute_decision_free(route(bad, 10 + i, rid));
        }
        CHECK_OK(kvroute_replication_flush(rbad));
        /* the good replica's own heartbeats come back: its inbound side runs */
        double seen = stat_num(rg, "received", NULL);
        WAIT_UNTIL(stat_num(rg, "received", NULL) >= seen + 2);
        CHECK(stat_num(rbad, "connected", NULL) == 0);
        CHECK(stat_num(rbad, "published", NULL) == 0);
        CHECK(inflight(good) == 0);
        CHECK(stat_num(rg, "replica", "effects_applied") == 0);
        CHECK(stat_num(rg, "replica", "peers") == 0);
    }
    kvroute_replication_free(rbad);
    kvroute_replication_free(rg);
    kvroute_router_free(bad);
    kvroute_router_free(good);
}

int main(int argc, char **argv) {
    if (argc > 1) g_wait_s = atof(argv[1]);
    snprintf(g_fleet_c, sizeof g_fleet_c, "c-%ld", (long)getpid());
    snprintf(g_fleet_w, sizeof g_fleet_w, "w-%ld", (long)getpid());
    /* Probe: without the feature, replicate says so and the test has nothing more to do. */
    kvroute_router *probe = new_router();
    kvroute_replication *rep = NULL;
    kvroute_result res = replicate(probe, "{\"replica_id\": \"probe\", \"url\": \"nats://127.0.0.1:1\"}", &rep);
    if (res == KVROUTE_RESULT_UNSUPPORTED) {
        printf("replicas: built without nats, skipped\n");
        kvroute_router_free(probe);
        return finish("replicas");
    }
    /* nothing listens there: no error, the thread keeps trying; freeing it stops it */
    CHECK_OK(res);
    CHECK(rep == NULL || stat_num(rep, "connected", NULL) == 0);
    kvroute_replication_free(rep);
    kvroute_router_free(probe);

    bad_arguments();

    const char *url = getenv("KVROUTE_NATS_URL");
    const char *token = getenv("KVROUTE_NATS_TOKEN");
    if (url == NULL || token == NULL) {
        fprintf(stderr, "replicas: KVROUTE_NATS_URL and KVROUTE_NATS_TOKEN must name a nats-server "
                        "(scripts/test-ffi.sh starts one; apt-get install nats-server)\n");
        return 1;
    }
    two_replicas(url, token);
    wrong_token(url, token);
    return finish("replicas");
}
