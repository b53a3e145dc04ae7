/* Replays the binding-neutral flow-control fixtures (the JSON files of fixtures/golden-flow, format
 * in its README.md) through the C API: every admission, release, cancel, stats and saturation
 * expectation the Rust replay (core/tests/golden_flow.rs) checks, with the same routing rule
 * (an admitted request is routed at once, a dispatched release is routed when taken, in order).
 *
 * With NATIVE_FLOW (written by `cargo test -p kvroute-ffi --test native_flow`: the same steps
 * replayed by the Rust core directly, one line per step with what it returned, flow control's
 * whole stats view and its next deadline; format in ffi/tests/native_flow.rs), the C replay must
 * also write exactly those lines, every one of them.
 *
 * Every case is replayed twice: with a release buffer larger than any batch, and with a buffer
 * of ONE release (each take returns one release and says how many remain; the caller routes it
 * and takes again): both must give the same results (nothing lost, nothing reordered).
 *
 * Usage: golden_flow FIXTURES_DIR [NATIVE_FLOW] */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>

#include <cJSON.h>

#include "common.h"

static char g_case[256];

#define FAIL(...)                                 \
    do {                                          \
        g_failures++;                             \
        fprintf(stderr, "%s: ", g_case);          \
        fprintf(stderr, __VA_ARGS__);             \
        fputc('\n', stderr);                      \
    } while (0)

/* ---- a growing string ---- */

typedef struct {
    char *s;
    size_t len, cap;
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...) {
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        size_t room = b->cap - b->len;
        int n = vsnprintf(b->s ? b->s + b->len : NULL, room, fmt, ap);
        va_end(ap);
        if (n < 0) return;
        if ((size_t)n < room) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + (size_t)n + 1) cap *= 2;
        b->s = realloc(b->s, cap);
        b->cap = cap;
    }
}

/* ---- the native trace: "name\tstep" keys and the rest of the line; `used` per pass ---- */

static struct native {
    char *key;
    char *value;
    int used;
} *g_native;
static size_t g_native_len;
static size_t g_native_compared;

static void load_native(const char *path) {
    char *text = read_file(path, NULL);
    if (text == NULL) {
        fprintf(stderr, "cannot read %s\n", path);
        exit(2);
    }
    size_t cap = 0;
    for (char *line = strtok(text, "\n"); line != NULL; line = strtok(NULL, "\n")) {
        char *tab1 = strchr(line, '\t');
        char *tab2 = tab1 ? strchr(tab1 + 1, '\t') : NULL;
        if (tab2 == NULL) continue;
        *tab2 = '\0';
        if (g_native_len == cap) {
            cap = cap ? 2 * cap : 256;
            g_native = realloc(g_native, cap * sizeof *g_native);
        }
        g_native[g_native_len].key = strdup(line);
        g_native[g_native_len].value = strdup(tab2 + 1);
        g_native[g_native_len].used = 0;
        g_native_len++;
    }
    free(text);
}

static void check_native(int step, const char *line, size_t cap) {
    if (g_native == NULL) return;
    char key[300];
    snprintf(key, sizeof key, "%s\t%d", g_case, step);
    g_checks++;
    for (size_t i = 0; i < g_native_len; i++) {
        if (strcmp(g_native[i].key, key) != 0) continue;
        g_native[i].used++;
        g_native_compared++;
        if (strcmp(g_native[i].value, line) != 0) {
            FAIL("step %d (release buffer %zu): the C replay differs from the native one\n  C:      %s\n  native: %s",
                 step, cap, line, g_native[i].value);
        }
        return;
    }
    FAIL("step %d: no native line", step);
}

/* ---- expectations (fixtures/golden-flow/README.md "Values compared") ---- */

/* `expect` matches `actual`: numbers within 1e-9, objects by subset, arrays element by element
 * and of equal length, anything else equal. */
static void check_json(const char *path, const cJSON *expect, const cJSON *actual) {
    g_checks++;
    if (actual == NULL) {
        FAIL("%s: missing", path);
        return;
    }
    if (cJSON_IsNumber(expect) && cJSON_IsNumber(actual)) {
        if (fabs(expect->valuedouble - actual->valuedouble) > 1e-9) {
            FAIL("%s: expected %.17g, got %.17g", path, expect->valuedouble, actual->valuedouble);
        }
        return;
    }
    if (cJSON_IsObject(expect) && cJSON_IsObject(actual)) {
        const cJSON *item;
        cJSON_ArrayForEach(item, expect) {
            char sub[512];
            snprintf(sub, sizeof sub, "%s.%s", path, item->string);
            check_json(sub, item, cJSON_GetObjectItemCaseSensitive(actual, item->string));
        }
        return;
    }
    if (cJSON_IsArray(expect) && cJSON_IsArray(actual) && cJSON_GetArraySize(expect) == cJSON_GetArraySize(actual)) {
        int i = 0;
        const cJSON *e = expect->child, *a = actual->child;
        for (; e && a; e = e->next, a = a->next, i++) {
            char sub[512];
            snprintf(sub, sizeof sub, "%s[%d]", path, i);
            check_json(sub, e, a);
        }
        return;
    }
    if (!cJSON_Compare(expect, actual, 1)) {
        char *e = cJSON_PrintUnformatted(expect), *a = cJSON_PrintUnformatted(actual);
        FAIL("%s: expected %s, got %s", path, e, a);
        free(e);
        free(a);
    }
}

static const char *str(const cJSON *obj, const char *key) {
    return cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(obj, key));
}

static double num(const cJSON *obj, const char *key, double fallback) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    return cJSON_IsNumber(v) ? v->valuedouble : fallback;
}

static kvroute_role role_of(const cJSON *v) {
    const char *s = cJSON_GetStringValue(v);
    if (s && strcmp(s, "prefill") == 0) return KVROUTE_ROLE_PREFILL;
    if (s && strcmp(s, "decode") == 0) return KVROUTE_ROLE_DECODE;
    if (s && strcmp(s, "both") == 0) return KVROUTE_ROLE_BOTH;
    return 0;
}

/* ---- the replayer's requests, by the case's ids ---- */

typedef struct {
    const char *id;         /* owned by the case's cJSON */
    char *body;             /* compact JSON */
    kvroute_header headers[16];
    size_t header_count;
    uint64_t ticket;        /* 0: never queued */
    int waiting;            /* the ticket has not ended */
    char request_id[128];
    int routed;
} held;

typedef struct {
    kvroute_router *r;
    held *h;
    size_t n, cap;
    size_t release_cap;     /* the release buffer's size */
} replay;

static held *find(replay *rp, const char *id) {
    for (size_t i = 0; id && i < rp->n; i++) {
        if (strcmp(rp->h[i].id, id) == 0) return &rp->h[i];
    }
    return NULL;
}

static held *by_ticket(replay *rp, uint64_t t) {
    for (size_t i = 0; i < rp->n; i++) {
        if (rp->h[i].waiting && rp->h[i].ticket == t) return &rp->h[i];
    }
    return NULL;
}

/* Route `h` at `now`; its view is {endpoint, shed} (or {error}); the trace gets "<endpoint or -> <shed>". */
static cJSON *route(replay *rp, held *h, uint64_t now, sbuf *trace, char sep) {
    kvroute_decision *d = NULL;
    kvroute_result res = kvroute_router_route(rp->r, h->body, strlen(h->body), h->header_count ? h->headers : NULL,
                                              h->header_count, now, &d);
    cJSON *v = cJSON_CreateObject();
    if (res != KVROUTE_RESULT_OK) {
        cJSON_AddStringToObject(v, "error", code_name(res));
        sb_printf(trace, "%serror", sep == ' ' ? " route " : "");
        return v;
    }
    char ep[128];
    bool shed = kvroute_decision_is_shed(d);
    kvroute_result er = kvroute_decision_endpoint(d, ep, sizeof ep, NULL);
    if (er == KVROUTE_RESULT_OK) {
        cJSON_AddStringToObject(v, "endpoint", ep);
    } else {
        if (er != KVROUTE_RESULT_ABSENT) FAIL("endpoint of a decision: %s", code_name(er));
        cJSON_AddNullToObject(v, "endpoint");
        snprintf(ep, sizeof ep, "-");
    }
    cJSON_AddBoolToObject(v, "shed", shed);
    if (sep == ' ') {
        sb_printf(trace, " route %s %d", ep, shed ? 1 : 0);
    } else {
        sb_printf(trace, "%s:%d", ep, shed ? 1 : 0);
    }
    if (!shed) {
        CHECK_OK(kvroute_decision_request_id(d, h->request_id, sizeof h->request_id, NULL));
        h->routed = 1;
    }
    kvroute_decision_free(d);
    return v;
}

/* ---- views ---- */

static void trace_stats(replay *rp, sbuf *trace, cJSON **view) {
    kvroute_flow_stats s;
    CHECK_OK(kvroute_router_flow_stats(rp->r, &s));
    kvroute_flow_band bands[64];
    size_t nb = 0;
    CHECK_OK(kvroute_router_flow_bands(rp->r, bands, 64, &nb));
    CHECK(nb == s.bands);
    sb_printf(trace, "\tq=%" PRIu64 " b=%" PRIu64 " w=%" PRIu64 " p=%" PRIu64 " bands=", s.queued, s.queued_bytes,
              s.releases_waiting, s.pending_dispatch);
    for (size_t i = 0; i < nb; i++) {
        sb_printf(trace, "%s%" PRId32 ":%" PRIu64 ":%" PRIu64 ":%" PRIu64 ":%.9f", i ? "," : "", bands[i].priority,
                  bands[i].queued, bands[i].queued_bytes, bands[i].active_flows, bands[i].ceiling);
    }
    sb_printf(trace, " c=%" PRIu64 ",%" PRIu64 ",%" PRIu64 ",%" PRIu64 ",%" PRIu64 " r=", s.admitted, s.enqueued,
              s.dispatched, s.cancelled, s.shed);
    for (kvroute_drop_reason k = 1; k <= 6; k++) {
        sb_printf(trace, "%s%" PRIu64, k > 1 ? "," : "", s.rejections[k]);
    }
    sb_printf(trace, " en=%d sd=%d", s.enabled ? 1 : 0, s.shutting_down ? 1 : 0);
    if (view == NULL) return;
    cJSON *v = cJSON_CreateObject();
    cJSON_AddNumberToObject(v, "queued", (double)s.queued);
    cJSON_AddNumberToObject(v, "queued_bytes", (double)s.queued_bytes);
    cJSON *bv = cJSON_AddObjectToObject(v, "bands");
    for (size_t i = 0; i < nb; i++) {
        char p[16];
        snprintf(p, sizeof p, "%" PRId32, bands[i].priority);
        cJSON_AddNumberToObject(bv, p, (double)bands[i].queued);
    }
    cJSON *c = cJSON_AddObjectToObject(v, "counters");
    cJSON_AddNumberToObject(c, "admitted", (double)s.admitted);
    cJSON_AddNumberToObject(c, "enqueued", (double)s.enqueued);
    cJSON_AddNumberToObject(c, "dispatched", (double)s.dispatched);
    cJSON_AddNumberToObject(c, "cancelled", (double)s.cancelled);
    cJSON_AddNumberToObject(c, "shed", (double)s.shed);
    cJSON *rj = cJSON_AddObjectToObject(c, "rejections");
    for (kvroute_drop_reason k = 1; k <= 6; k++) {
        char name[64];
        snprintf(name, sizeof name, "%s", kvroute_drop_reason_name(k));
        for (char *q = name; *q; q++) {
            if (*q == '-') *q = '_';
        }
        cJSON_AddNumberToObject(rj, name, (double)s.rejections[k]);
    }
    *view = v;
}

static cJSON *admission_view(const kvroute_admission *a) {
    switch (a->kind) {
        case KVROUTE_ADMISSION_ADMIT:
            return cJSON_CreateString("admit");
        case KVROUTE_ADMISSION_QUEUED:
            return cJSON_CreateString("queued");
        case KVROUTE_ADMISSION_REJECTED: {
            cJSON *v = cJSON_CreateObject();
            cJSON *rej = cJSON_AddObjectToObject(v, "rejected");
            cJSON_AddNumberToObject(rej, "status", a->rejection.status);
            cJSON_AddStringToObject(rej, "reason", a->rejection.reason_name);
            return v;
        }
        default:
            return cJSON_CreateString("unknown admission kind");
    }
}

/* ---- steps ---- */

static void step_admit(replay *rp, const cJSON *step, const cJSON *default_body, const char *at, sbuf *trace) {
    if (rp->n == rp->cap) {
        rp->cap = rp->cap ? 2 * rp->cap : 32;
        rp->h = realloc(rp->h, rp->cap * sizeof *rp->h);
    }
    held *h = &rp->h[rp->n++];
    memset(h, 0, sizeof *h);
    h->id = str(step, "id");
    const cJSON *body = cJSON_GetObjectItemCaseSensitive(step, "body");
    h->body = cJSON_PrintUnformatted(body ? body : default_body);
    const cJSON *hv;
    cJSON_ArrayForEach(hv, cJSON_GetObjectItemCaseSensitive(step, "headers")) {
        if (h->header_count == 16) break;
        const char *value = cJSON_GetStringValue(hv);
        kvroute_header *k = &h->headers[h->header_count++];
        k->name = hv->string;
        k->name_len = strlen(hv->string);
        k->value = value;
        k->value_len = value ? strlen(value) : 0;
    }
    uint64_t now = (uint64_t)num(step, "now_ms", 0);
    kvroute_admission a;
    kvroute_result res = kvroute_router_admit(rp->r, h->body, strlen(h->body), h->header_count ? h->headers : NULL,
                                              h->header_count, now, &a);
    g_checks++;
    if (res != KVROUTE_RESULT_OK) {
        FAIL("%s: admit gave %s (%s)", at, code_name(res), last_error());
        sb_printf(trace, "error");
        return;
    }
    switch (a.kind) {
        case KVROUTE_ADMISSION_ADMIT:
            sb_printf(trace, "admit");
            CHECK(a.ticket == 0 && a.rejection.reason == KVROUTE_DROP_REASON_NONE && a.rejection.reason_name == NULL);
            break;
        case KVROUTE_ADMISSION_QUEUED:
            sb_printf(trace, "queued");
            CHECK(a.ticket != 0 && by_ticket(rp, a.ticket) == NULL && a.rejection.status == 0);
            h->ticket = a.ticket;
            h->waiting = 1;
            break;
        default:
            sb_printf(trace, "rejected %u %s", (unsigned)a.rejection.status, a.rejection.reason_name);
            CHECK(a.ticket == 0 && a.rejection.reason_name != NULL &&
                  strcmp(a.rejection.reason_name, kvroute_drop_reason_name(a.rejection.reason)) == 0);
            break;
    }
    cJSON *actual = admission_view(&a);
    char path[320];
    snprintf(path, sizeof path, "%s admission", at);
    check_json(path, cJSON_GetObjectItemCaseSensitive(step, "expect"), actual);
    cJSON_Delete(actual);
    const cJSON *route_flag = cJSON_GetObjectItemCaseSensitive(step, "route");
    if (a.kind == KVROUTE_ADMISSION_ADMIT && !cJSON_IsFalse(route_flag)) {
        cJSON *v = route(rp, h, now, trace, ' ');
        const cJSON *er = cJSON_GetObjectItemCaseSensitive(step, "expect_route");
        if (er) {
            snprintf(path, sizeof path, "%s route", at);
            check_json(path, er, v);
        }
        cJSON_Delete(v);
    }
}

static void step_releases(replay *rp, const cJSON *step, const char *at, sbuf *trace) {
    uint64_t now = (uint64_t)num(step, "now_ms", 0);
    int do_route = !cJSON_IsFalse(cJSON_GetObjectItemCaseSensitive(step, "route"));
    sb_printf(trace, "releases");
    cJSON *views = cJSON_CreateArray();
    kvroute_release *buf = calloc(rp->release_cap, sizeof *buf);
    size_t remaining = 0;
    do {
        size_t n = 0;
        remaining = (size_t)-1;
        kvroute_result res = kvroute_router_take_releases(rp->r, now, buf, rp->release_cap, &n, &remaining);
        g_checks++;
        if (res != KVROUTE_RESULT_OK) {
            FAIL("%s: take_releases gave %s (%s)", at, code_name(res), last_error());
            break;
        }
        CHECK(n <= rp->release_cap);
        for (size_t i = 0; i < n; i++) {
            const kvroute_release *rel = &buf[i];
            held *h = by_ticket(rp, rel->ticket);
            char unknown[64];
            snprintf(unknown, sizeof unknown, "unknown-%" PRIu64, rel->ticket);
            const char *id = h ? h->id : unknown;
            if (h) h->waiting = 0;
            cJSON *v = cJSON_CreateObject();
            cJSON_AddStringToObject(v, "id", id);
            cJSON_AddStringToObject(v, "outcome", kvroute_release_outcome_name(rel->outcome));
            if (rel->outcome == KVROUTE_RELEASE_DISPATCHED) {
                CHECK(rel->rejection.status == 0 && rel->rejection.reason_name == NULL);
                cJSON_AddNumberToObject(v, "waited_ms", (double)rel->waited_ms);
                sb_printf(trace, " %s:dispatched:%" PRIu64 ":", id, rel->waited_ms);
                if (do_route && h) cJSON_AddItemToObject(v, "route", route(rp, h, now, trace, ':'));
            } else {
                CHECK(rel->outcome == KVROUTE_RELEASE_DROPPED && rel->rejection.reason_name != NULL);
                cJSON_AddNumberToObject(v, "status", rel->rejection.status);
                cJSON_AddStringToObject(v, "reason", rel->rejection.reason_name);
                cJSON_AddNumberToObject(v, "waited_ms", (double)rel->waited_ms);
                sb_printf(trace, " %s:dropped:%u:%s:%" PRIu64, id, (unsigned)rel->rejection.status,
                          rel->rejection.reason_name, rel->waited_ms);
            }
            cJSON_AddItemToArray(views, v);
        }
        if (remaining > 0) CHECK(n == rp->release_cap); /* a short copy only when nothing remains */
    } while (remaining > 0);
    free(buf);
    char path[320];
    snprintf(path, sizeof path, "%s releases", at);
    check_json(path, cJSON_GetObjectItemCaseSensitive(step, "expect"), views);
    cJSON_Delete(views);
}

static void step_metrics(replay *rp, const cJSON *step) {
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(step, "metrics");
    kvroute_metrics km = {0};
    km.waiting = (uint32_t)num(m, "waiting", 0);
    km.running = (uint32_t)num(m, "running", 0);
    km.kv_usage = num(m, "kv_usage", 0);
    km.updated_ms = (uint64_t)num(m, "updated_ms", 0);
    CHECK_OK(kvroute_router_update_metrics(rp->r, str(step, "endpoint"), &km));
}

static void step_saturation(replay *rp, const cJSON *step, const char *at, sbuf *trace) {
    kvroute_flow_saturation s;
    CHECK_OK(kvroute_router_flow_saturation(rp->r, (uint64_t)num(step, "now_ms", 0), &s));
    sb_printf(trace, "saturation %.9f %.9f ", s.pool, s.decode);
    if (s.has_prefill) {
        sb_printf(trace, "%.9f", s.prefill);
    } else {
        sb_printf(trace, "none");
    }
    sb_printf(trace, " %" PRIu32, s.decode_endpoints);
    cJSON *v = cJSON_CreateObject();
    cJSON_AddNumberToObject(v, "pool", s.pool);
    cJSON_AddNumberToObject(v, "decode", s.decode);
    if (s.has_prefill) {
        cJSON_AddNumberToObject(v, "prefill", s.prefill);
    } else {
        cJSON_AddNullToObject(v, "prefill");
    }
    cJSON_AddNumberToObject(v, "decode_endpoints", s.decode_endpoints);
    char path[320];
    snprintf(path, sizeof path, "%s saturation", at);
    check_json(path, cJSON_GetObjectItemCaseSensitive(step, "expect"), v);
    cJSON_Delete(v);
}

static void run_case(const char *path, size_t release_cap) {
    char *text = read_file(path, NULL);
    cJSON *c = text ? cJSON_Parse(text) : NULL;
    free(text);
    if (c == NULL) {
        snprintf(g_case, sizeof g_case, "%s", path);
        FAIL("cannot read or parse");
        return;
    }
    snprintf(g_case, sizeof g_case, "%s", str(c, "name"));
    char *ptext = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(c, "policy"));
    replay rp = {0};
    rp.release_cap = release_cap;
    CHECK_OK(kvroute_router_new(ptext, ptext ? strlen(ptext) : 0, &rp.r));
    cJSON_free(ptext);
    if (rp.r == NULL) {
        cJSON_Delete(c);
        return;
    }
    cJSON *default_body = cJSON_GetObjectItemCaseSensitive(c, "body");
    cJSON *fallback = NULL;
    if (default_body == NULL) {
        fallback = cJSON_Parse("{\"model\":\"m\",\"prompt\":\"hello\",\"max_tokens\":16}");
        default_body = fallback;
    }
    const cJSON *e;
    cJSON_ArrayForEach(e, cJSON_GetObjectItemCaseSensitive(c, "endpoints")) {
        kvroute_role role = role_of(cJSON_GetObjectItemCaseSensitive(e, "role"));
        CHECK_OK(kvroute_router_upsert_endpoint(rp.r, str(e, "id"), role));
    }
    int i = 0;
    const cJSON *step;
    sbuf line = {0};
    cJSON_ArrayForEach(step, cJSON_GetObjectItemCaseSensitive(c, "steps")) {
        char at[300];
        snprintf(at, sizeof at, "step %d", i);
        const char *op = str(step, "op");
        line.len = 0;
        sb_printf(&line, "%s", "");
        if (strcmp(op, "admit") == 0) {
            step_admit(&rp, step, default_body, at, &line);
        } else if (strcmp(op, "releases") == 0) {
            step_releases(&rp, step, at, &line);
        } else if (strcmp(op, "tick") == 0) {
            CHECK_OK(kvroute_router_flow_tick(rp.r, (uint64_t)num(step, "now_ms", 0)));
            sb_printf(&line, "%s", op);
        } else if (strcmp(op, "complete") == 0) {
            held *h = find(&rp, str(step, "id"));
            g_checks++;
            if (h && h->routed) {
                CHECK_OK(kvroute_router_complete(rp.r, h->request_id));
            } else {
                FAIL("%s: %s was not routed", at, str(step, "id"));
            }
            sb_printf(&line, "%s", op);
        } else if (strcmp(op, "cancel") == 0) {
            held *h = find(&rp, str(step, "id"));
            uint64_t t = h ? h->ticket : 0;
            bool found = false;
            CHECK_OK(kvroute_router_cancel(rp.r, t, &found));
            if (found && h) h->waiting = 0;
            sb_printf(&line, "cancel %s", found ? "true" : "false");
            cJSON *v = cJSON_CreateBool(found);
            char path2[320];
            snprintf(path2, sizeof path2, "%s cancel", at);
            check_json(path2, cJSON_GetObjectItemCaseSensitive(step, "expect"), v);
            cJSON_Delete(v);
        } else if (strcmp(op, "shutdown") == 0) {
            CHECK_OK(kvroute_router_shutdown_queue(rp.r));
            sb_printf(&line, "%s", op);
        } else if (strcmp(op, "metrics") == 0) {
            step_metrics(&rp, step);
            sb_printf(&line, "%s", op);
        } else if (strcmp(op, "set_healthy") == 0) {
            CHECK_OK(kvroute_router_set_healthy(rp.r, str(step, "endpoint"),
                                                cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(step, "healthy"))));
            sb_printf(&line, "%s", op);
        } else if (strcmp(op, "upsert_endpoint") == 0) {
            CHECK_OK(kvroute_router_upsert_endpoint(rp.r, str(step, "endpoint"),
                                                    role_of(cJSON_GetObjectItemCaseSensitive(step, "role"))));
            sb_printf(&line, "%s", op);
        } else if (strcmp(op, "remove_endpoint") == 0) {
            CHECK_OK(kvroute_router_remove_endpoint(rp.r, str(step, "endpoint")));
            sb_printf(&line, "%s", op);
        } else if (strcmp(op, "reload") == 0) {
            char *p = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(step, "policy"));
            CHECK_OK(kvroute_router_reload(rp.r, p, strlen(p), NULL));
            cJSON_free(p);
            sb_printf(&line, "%s", op);
        } else if (strcmp(op, "stats") == 0) {
            sb_printf(&line, "%s", op);
        } else if (strcmp(op, "saturation") == 0) {
            step_saturation(&rp, step, at, &line);
        } else {
            FAIL("%s: unknown op %s", at, op);
        }
        /* After every step: the whole stats view and the next deadline (the native trace's columns). */
        cJSON *sv = NULL;
        trace_stats(&rp, &line, strcmp(op, "stats") == 0 ? &sv : NULL);
        if (sv) {
            char path2[320];
            snprintf(path2, sizeof path2, "%s stats", at);
            check_json(path2, cJSON_GetObjectItemCaseSensitive(step, "expect"), sv);
            cJSON_Delete(sv);
        }
        uint64_t deadline = 0;
        kvroute_result dr = kvroute_router_next_flow_deadline(rp.r, &deadline);
        if (dr == KVROUTE_RESULT_OK) {
            sb_printf(&line, "\td=%" PRIu64, deadline);
        } else {
            CHECK(dr == KVROUTE_RESULT_ABSENT);
            sb_printf(&line, "\td=none");
        }
        check_native(i, line.s, release_cap);
        i++;
    }
    /* Every ticket the case issued has ended. */
    for (size_t k = 0; k < rp.n; k++) {
        g_checks++;
        if (rp.h[k].waiting) FAIL("ticket of %s still held at the end", rp.h[k].id);
        cJSON_free(rp.h[k].body);
    }
    free(rp.h);
    free(line.s);
    cJSON_Delete(fallback);
    kvroute_router_free(rp.r);
    cJSON_Delete(c);
}

static int compare_names(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int main(int argc, char **argv) {
    if (argc != 2 && argc != 3) {
        fprintf(stderr, "usage: %s FIXTURES_DIR [NATIVE_FLOW]\n", argv[0]);
        return 2;
    }
    if (argc == 3) load_native(argv[2]);
    DIR *dir = opendir(argv[1]);
    if (dir == NULL) {
        perror(argv[1]);
        return 2;
    }
    char *files[256];
    size_t n = 0;
    struct dirent *ent;
    while ((ent = readdir(dir)) != NULL && n < 256) {
        size_t len = strlen(ent->d_name);
        if (len > 5 && strcmp(ent->d_name + len - 5, ".json") == 0) {
            size_t plen = strlen(argv[1]) + len + 2;
            files[n] = malloc(plen);
            snprintf(files[n], plen, "%s/%s", argv[1], ent->d_name);
            n++;
        }
    }
    closedir(dir);
    qsort(files, n, sizeof *files, compare_names);
    CHECK(n >= 10);
    const size_t caps[2] = {256, 1};
    for (int pass = 0; pass < 2; pass++) {
        for (size_t i = 0; i < n; i++) run_case(files[i], caps[pass]);
    }
    for (size_t i = 0; i < n; i++) free(files[i]);
    if (g_native != NULL) {
        snprintf(g_case, sizeof g_case, "native trace");
        for (size_t i = 0; i < g_native_len; i++) {
            g_checks++;
            if (g_native[i].used != 2) FAIL("line %s compared %d times, not twice", g_native[i].key, g_native[i].used);
            free(g_native[i].key);
            free(g_native[i].value);
        }
        free(g_native);
        printf("golden_flow: %zu native lines, each compared with the C replay with both release buffers\n",
               g_native_len);
    }
    printf("golden_flow: %zu cases replayed twice (release buffers of 256 and 1)\n", n);
    return finish("golden_flow");
}
