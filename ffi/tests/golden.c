/* Replays the binding-neutral golden fixture suite (the JSON files of fixtures/golden, format
 * in its README.md) through the C API and checks every decision against the expectations the Rust
 * replay (core/tests/golden.rs) checks: the C library decides exactly as the core.
 *
 * With NATIVE_DECISIONS (written by `cargo test -p kvroute-ffi --test native_decisions`: the
 * same steps routed by the Rust core directly, one `name TAB step TAB Decision::to_json` line per
 * route step), every decision's `kvroute_decision_to_json` must also equal the native one byte
 * for byte, and every native line must be matched.
 *
 * Usage: golden FIXTURES_DIR [NATIVE_DECISIONS] */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <math.h>

#include <cJSON.h>

#include "common.h"

static char g_case[256];

/* The native decisions: "name\tstep" keys and their JSON (or "error"); `used` when matched. */
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
            cap = cap ? 2 * cap : 128;
            g_native = realloc(g_native, cap * sizeof *g_native);
        }
        g_native[g_native_len].key = strdup(line);
        g_native[g_native_len].value = strdup(tab2 + 1);
        g_native[g_native_len].used = 0;
        g_native_len++;
    }
    free(text);
}

/* Compare a route step's outcome with the native one (`json` NULL for a failed route). */
static void check_native(const char *at, const char *json) {
    if (g_native == NULL) return;
    char key[600];
    snprintf(key, sizeof key, "%s\t%s", g_case, at + 5); /* at = "step N" */
    g_checks++;
    for (size_t i = 0; i < g_native_len; i++) {
        if (strcmp(g_native[i].key, key) != 0) continue;
        g_native[i].used = 1;
        g_native_compared++;
        const char *want = g_native[i].value;
        if (json == NULL ? strcmp(want, "error") != 0 : strcmp(want, json) != 0) {
            g_failures++;
            fprintf(stderr, "%s: %s: the C decision differs from the native one\n  C:      %s\n  native: %s\n",
                    g_case, at, json ? json : "error", want);
        }
        return;
    }
    g_failures++;
    fprintf(stderr, "%s: %s: no native decision\n", g_case, at);
}

#define FAIL(...)                                 \
    do {                                          \
        g_failures++;                             \
        fprintf(stderr, "%s: ", g_case);          \
        fprintf(stderr, __VA_ARGS__);             \
        fputc('\n', stderr);                      \
    } while (0)

/* ---- the decision as the fixtures see it (fixtures/golden/README.md) ---- */

static cJSON *string_or_null(string_getter get, const kvroute_decision *d) {
    char *s = dup_string(get, d);
    cJSON *v = s ? cJSON_CreateString(s) : cJSON_CreateNull();
    free(s);
    return v;
}

static cJSON *name_or_null(const char *name) {
    return name ? cJSON_CreateString(name) : cJSON_CreateNull();
}

static cJSON *view(const kvroute_decision *d) {
    cJSON *v = cJSON_CreateObject();
    cJSON_AddItemToObject(v, "request_id", string_or_null(kvroute_decision_request_id, d));
    cJSON_AddNumberToObject(v, "policy_version", (double)kvroute_decision_policy_version(d));
    cJSON_AddItemToObject(v, "rule", name_or_null(kvroute_rule_name(kvroute_decision_rule(d))));
    cJSON_AddItemToObject(v, "mode", name_or_null(kvroute_mode_name(kvroute_decision_mode(d))));
    cJSON_AddItemToObject(v, "endpoint", string_or_null(kvroute_decision_endpoint, d));
    cJSON_AddItemToObject(v, "prefill_endpoint", string_or_null(kvroute_decision_prefill_endpoint, d));
    cJSON_AddBoolToObject(v, "shed", kvroute_decision_is_shed(d));
    if (kvroute_decision_is_shed(d)) {
        cJSON_AddNumberToObject(v, "status", kvroute_decision_shed_status(d));
    } else {
        cJSON_AddNullToObject(v, "status");
    }
    cJSON *headers = cJSON_AddObjectToObject(v, "headers");
    char name[256], value[1024];
    for (size_t i = 0; i < kvroute_decision_header_count(d); i++) {
        if (kvroute_decision_header_name(d, i, name, sizeof name, NULL) == KVROUTE_RESULT_OK &&
            kvroute_decision_header_value(d, i, value, sizeof value, NULL) == KVROUTE_RESULT_OK) {
            cJSON_AddStringToObject(headers, name, value);
        } else {
            FAIL("header %zu could not be read: %s", i, last_error());
        }
    }
    cJSON_AddNumberToObject(v, "prefix_hit", kvroute_decision_prefix_hit(d));
    cJSON_AddNumberToObject(v, "cached_tokens", (double)kvroute_decision_cached_tokens(d));
    cJSON_AddNumberToObject(v, "input_tokens", (double)kvroute_decision_input_tokens(d));
    cJSON_AddBoolToObject(v, "relaxed_filters", kvroute_decision_relaxed_filters(d));
    kvroute_judgment j;
    if (kvroute_decision_judgment(d, &j) == KVROUTE_RESULT_OK) {
        cJSON *jv = cJSON_AddObjectToObject(v, "judgment");
        cJSON_AddItemToObject(jv, "horizon", name_or_null(kvroute_horizon_name(j.horizon)));
        cJSON_AddNumberToObject(jv, "risk", j.risk);
        if (j.has_bypass_probability) {
            cJSON_AddNumberToObject(jv, "bypass_probability", j.bypass_probability);
        } else {
            cJSON_AddNullToObject(jv, "bypass_probability");
        }
        cJSON_AddItemToObject(jv, "source", name_or_null(kvroute_judgment_source_name(j.source)));
    } else {
        FAIL("judgment could not be read: %s", last_error());
    }
    kvroute_transfer t;
    kvroute_result tr = kvroute_decision_transfer(d, &t);
    if (tr == KVROUTE_RESULT_OK) {
        cJSON_AddBoolToObject(v, "transfer_pays", t.pays);
    } else if (tr == KVROUTE_RESULT_ABSENT) {
        cJSON_AddNullToObject(v, "transfer_pays");
    } else {
        FAIL("transfer could not be read: %s", code_name(tr));
    }
    cJSON *filtered = cJSON_AddObjectToObject(v, "filtered");
    cJSON *scores = cJSON_AddObjectToObject(v, "scores");
    for (size_t i = 0; i < kvroute_decision_score_count(d); i++) {
        char ep[128];
        kvroute_endpoint_score s;
        if (kvroute_decision_score_endpoint(d, i, ep, sizeof ep, NULL) != KVROUTE_RESULT_OK ||
            kvroute_decision_score(d, i, &s) != KVROUTE_RESULT_OK) {
            FAIL("score %zu could not be read: %s", i, last_error());
            continue;
        }
        cJSON_AddItemToObject(filtered, ep, name_or_null(kvroute_filter_name(s.filtered)));
        cJSON *sv = cJSON_AddObjectToObject(scores, ep);
        cJSON_AddNumberToObject(sv, "matched_blocks", s.matched_blocks);
        cJSON_AddNumberToObject(sv, "cached_tokens", (double)s.cached_tokens);
        cJSON_AddBoolToObject(sv, "precise", s.precise);
        cJSON_AddNumberToObject(sv, "prefix_hit", s.prefix_hit);
        cJSON_AddNumberToObject(sv, "lora", s.lora);
        cJSON_AddNumberToObject(sv, "queue", s.queue);
        cJSON_AddNumberToObject(sv, "kv_usage", s.kv_usage);
        cJSON_AddNumberToObject(sv, "session", s.session);
        cJSON_AddNumberToObject(sv, "inflight", s.inflight);
        cJSON_AddNumberToObject(sv, "total", s.total);
    }
    return v;
}

/* `expect` matches `actual`: numbers within 1e-9, objects by subset except `headers` (exact). */
static void check_json(const char *path, const cJSON *expect, const cJSON *actual) {
    g_checks++;
    if (actual == NULL) {
        FAIL("%s: missing", path);
        return;
    }
    if (cJSON_IsNumber(expect)) {
        if (!cJSON_IsNumber(actual) || fabs(expect->valuedouble - actual->valuedouble) > 1e-9) {
            char *a = cJSON_PrintUnformatted(actual);
            FAIL("%s: expected %.17g, got %s", path, expect->valuedouble, a);
            free(a);
        }
        return;
    }
    if (cJSON_IsObject(expect)) {
        if (!cJSON_IsObject(actual)) {
            FAIL("%s: expected an object", path);
            return;
        }
        size_t plen = strlen(path);
        if (plen >= 7 && strcmp(path + plen - 7, "headers") == 0 &&
            cJSON_GetArraySize(expect) != cJSON_GetArraySize(actual)) {
            char *e = cJSON_PrintUnformatted(expect), *a = cJSON_PrintUnformatted(actual);
            FAIL("%s: expected exactly %s, got %s", path, e, a);
            free(e);
            free(a);
            return;
        }
        const cJSON *item;
        cJSON_ArrayForEach(item, expect) {
            char sub[512];
            snprintf(sub, sizeof sub, "%s.%s", path, item->string);
            check_json(sub, item, cJSON_GetObjectItemCaseSensitive(actual, item->string));
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

/* ---- steps ---- */

static kvroute_role role_of(const cJSON *v) {
    const char *s = cJSON_GetStringValue(v);
    if (s && strcmp(s, "prefill") == 0) return KVROUTE_ROLE_PREFILL;
    if (s && strcmp(s, "decode") == 0) return KVROUTE_ROLE_DECODE;
    if (s && strcmp(s, "both") == 0) return KVROUTE_ROLE_BOTH;
    return 0;
}

static const char *str(const cJSON *obj, const char *key) {
    return cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(obj, key));
}

static double num(const cJSON *obj, const char *key, double fallback) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    return cJSON_IsNumber(v) ? v->valuedouble : fallback;
}

/* A JSON array of strings as a C array (the strings stay owned by cJSON). */
static const char **string_array(const cJSON *arr, size_t *len) {
    *len = 0;
    if (!cJSON_IsArray(arr) || cJSON_GetArraySize(arr) == 0) return NULL;
    const char **out = calloc((size_t)cJSON_GetArraySize(arr), sizeof *out);
    const cJSON *item;
    cJSON_ArrayForEach(item, arr) { out[(*len)++] = cJSON_GetStringValue(item); }
    return out;
}

static void step_metrics(kvroute_router *r, const cJSON *step) {
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(step, "metrics");
    kvroute_metrics km = {0};
    km.waiting = (uint32_t)num(m, "waiting", 0);
    km.running = (uint32_t)num(m, "running", 0);
    km.kv_usage = num(m, "kv_usage", 0);
    km.updated_ms = (uint64_t)num(m, "updated_ms", 0);
    km.lora_running = string_array(cJSON_GetObjectItemCaseSensitive(m, "lora_running"), &km.lora_running_len);
    km.lora_waiting = string_array(cJSON_GetObjectItemCaseSensitive(m, "lora_waiting"), &km.lora_waiting_len);
    const cJSON *max_lora = cJSON_GetObjectItemCaseSensitive(m, "max_lora");
    if (cJSON_IsNumber(max_lora)) {
        km.has_max_lora = true;
        km.max_lora = (uint32_t)max_lora->valuedouble;
    }
    const cJSON *cap = cJSON_GetObjectItemCaseSensitive(m, "kv_capacity_tokens");
    if (cJSON_IsNumber(cap)) {
        km.has_kv_capacity_tokens = true;
        km.kv_capacity_tokens = (uint64_t)cap->valuedouble;
    }
    CHECK_OK(kvroute_router_update_metrics(r, str(step, "endpoint"), &km));
    free((void *)km.lora_running);
    free((void *)km.lora_waiting);
}

static void step_route(kvroute_router *r, const cJSON *step, const char *at) {
    const cJSON *body = cJSON_GetObjectItemCaseSensitive(step, "body");
    char *text = body ? cJSON_PrintUnformatted(body) : NULL;
    const char *raw = str(step, "body_raw");
    const char *b = text ? text : raw;
    if (b == NULL) {
        FAIL("%s: a route step needs `body` or `body_raw`", at);
        return;
    }
    const cJSON *hs = cJSON_GetObjectItemCaseSensitive(step, "headers");
    size_t nh = 0;
    kvroute_header headers[16];
    const cJSON *h;
    cJSON_ArrayForEach(h, hs) {
        if (nh == 16) break;
        const char *value = cJSON_GetStringValue(h);
        headers[nh].name = h->string;
        headers[nh].name_len = strlen(h->string);
        headers[nh].value = value;
        headers[nh].value_len = value ? strlen(value) : 0;
        nh++;
    }
    uint64_t now = (uint64_t)num(step, "now_ms", 0);
    kvroute_decision *d = NULL;
    kvroute_result res = kvroute_router_route(r, b, strlen(b), nh ? headers : NULL, nh, now, &d);
    const cJSON *expect_error = cJSON_GetObjectItemCaseSensitive(step, "expect_error");
    g_checks++;
    if (res == KVROUTE_RESULT_OK) {
        char *json = dup_string(kvroute_decision_to_json, d);
        if (json == NULL) FAIL("%s: kvroute_decision_to_json failed: %s", at, last_error());
        check_native(at, json);
        free(json);
    } else {
        check_native(at, NULL);
    }
    if (res == KVROUTE_RESULT_OK && expect_error == NULL) {
        const cJSON *expect = cJSON_GetObjectItemCaseSensitive(step, "expect");
        if (expect) {
            cJSON *actual = view(d);
            check_json(at, expect, actual);
            cJSON_Delete(actual);
        }
        if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(step, "complete")) && !kvroute_decision_is_shed(d)) {
            char id[256];
            CHECK_OK(kvroute_decision_request_id(d, id, sizeof id, NULL));
            CHECK_OK(kvroute_router_complete(r, id));
        }
    } else if (res != KVROUTE_RESULT_OK && expect_error != NULL) {
        const char *kind = str(expect_error, "kind");
        kvroute_result want = strcmp(kind, "request") == 0        ? KVROUTE_RESULT_REQUEST_ERROR
                              : strcmp(kind, "no_endpoints") == 0 ? KVROUTE_RESULT_NO_ENDPOINTS
                                                                  : -1;
        if (res != want) FAIL("%s: expected error %s, got %s (%s)", at, kind, code_name(res), last_error());
        char got[256];
        const char *field = str(expect_error, "field");
        if (field) {
            if (kvroute_last_error_field(got, sizeof got, NULL) != KVROUTE_RESULT_OK || strcmp(got, field) != 0) {
                FAIL("%s: expected error field %s (last error: %s)", at, field, last_error());
            }
        }
        const char *header = str(expect_error, "header");
        if (header) {
            if (kvroute_last_error_header(got, sizeof got, NULL) != KVROUTE_RESULT_OK || strcmp(got, header) != 0) {
                FAIL("%s: expected error header %s (last error: %s)", at, header, last_error());
            }
        }
        if (d != NULL) FAIL("%s: the out-parameter was written on failure", at);
    } else if (res == KVROUTE_RESULT_OK) {
        FAIL("%s: expected an error, got a decision", at);
    } else {
        FAIL("%s: unexpected error %s: %s", at, code_name(res), last_error());
    }
    kvroute_decision_free(d);
    cJSON_free(text);
}

static void step_events(kvroute_router *r, const cJSON *step, const char *at) {
    size_t len = 0;
    unsigned char *payload = hex_decode(str(step, "payload_hex"), &len);
    const cJSON *seqv = cJSON_GetObjectItemCaseSensitive(step, "seq");
    uint64_t seq = cJSON_IsNumber(seqv) ? (uint64_t)seqv->valuedouble : 0;
    kvroute_apply_outcome o;
    memset(&o, 0xAB, sizeof o);
    kvroute_result res = kvroute_router_apply_events(r, str(step, "endpoint"), payload, len,
                                                     cJSON_IsNumber(seqv) ? &seq : NULL,
                                                     (uint64_t)num(step, "now_ms", 0), &o);
    const cJSON *expect_error = cJSON_GetObjectItemCaseSensitive(step, "expect_error");
    g_checks++;
    if (res == KVROUTE_RESULT_OK && expect_error == NULL) {
        const cJSON *expect = cJSON_GetObjectItemCaseSensitive(step, "expect");
        if (expect) {
            cJSON *actual = cJSON_CreateObject();
            cJSON_AddStringToObject(actual, "verdict", kvroute_verdict_name(o.verdict));
            if (o.verdict == KVROUTE_VERDICT_GAP) {
                cJSON_AddNumberToObject(actual, "expected", (double)o.expected);
                cJSON_AddNumberToObject(actual, "got", (double)o.got);
            }
            cJSON_AddNumberToObject(actual, "blocks", (double)o.blocks);
            cJSON_AddNumberToObject(actual, "events", o.events);
            check_json(at, expect, actual);
            cJSON_Delete(actual);
        }
    } else if (res == KVROUTE_RESULT_EVENT_DECODE_ERROR && expect_error != NULL &&
               strcmp(str(expect_error, "kind"), "decode") == 0) {
        unsigned char untouched[sizeof o];
        memset(untouched, 0xAB, sizeof untouched);
        if (memcmp(&o, untouched, sizeof o) != 0) FAIL("%s: the outcome was written on failure", at);
    } else {
        FAIL("%s: events gave %s (%s)", at, code_name(res), res == KVROUTE_RESULT_OK ? "" : last_error());
    }
    free(payload);
}

static void run_case(const char *path) {
    char *text = read_file(path, NULL);
    cJSON *c = text ? cJSON_Parse(text) : NULL;
    free(text);
    if (c == NULL) {
        snprintf(g_case, sizeof g_case, "%s", path);
        FAIL("cannot read or parse");
        return;
    }
    snprintf(g_case, sizeof g_case, "%s", str(c, "name"));
    const cJSON *policy = cJSON_GetObjectItemCaseSensitive(c, "policy");
    char *ptext = policy ? cJSON_PrintUnformatted(policy) : NULL;
    kvroute_router *r = NULL;
    CHECK_OK(kvroute_router_new(ptext, ptext ? strlen(ptext) : 0, &r));
    cJSON_free(ptext);
    if (r == NULL) {
        cJSON_Delete(c);
        return;
    }
    const cJSON *e;
    cJSON_ArrayForEach(e, cJSON_GetObjectItemCaseSensitive(c, "endpoints")) {
        CHECK_OK(kvroute_router_upsert_endpoint(r, str(e, "id"), role_of(cJSON_GetObjectItemCaseSensitive(e, "role"))));
    }
    int i = 0;
    const cJSON *step;
    cJSON_ArrayForEach(step, cJSON_GetObjectItemCaseSensitive(c, "steps")) {
        char at[300];
        snprintf(at, sizeof at, "step %d", i++);
        const char *op = str(step, "op");
        if (strcmp(op, "metrics") == 0) {
            step_metrics(r, step);
        } else if (strcmp(op, "upsert_endpoint") == 0) {
            CHECK_OK(kvroute_router_upsert_endpoint(r, str(step, "id"),
                                                    role_of(cJSON_GetObjectItemCaseSensitive(step, "role"))));
        } else if (strcmp(op, "remove_endpoint") == 0) {
            CHECK_OK(kvroute_router_remove_endpoint(r, str(step, "id")));
        } else if (strcmp(op, "set_healthy") == 0) {
            CHECK_OK(kvroute_router_set_healthy(r, str(step, "id"),
                                                cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(step, "healthy"))));
        } else if (strcmp(op, "reload") == 0 || strcmp(op, "reload_invalid") == 0) {
            char *p = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(step, "policy"));
            uint64_t before = kvroute_router_policy_version(r), version = 0;
            if (op[6] == '\0') {
                CHECK_OK(kvroute_router_reload(r, p, strlen(p), &version));
                CHECK(version == before + 1);
            } else {
                CHECK_CODE(kvroute_router_reload(r, p, strlen(p), &version), KVROUTE_RESULT_CONFIG_ERROR);
                CHECK(version == 0);
                CHECK(kvroute_router_policy_version(r) == before);
            }
            cJSON_free(p);
        } else if (strcmp(op, "resync") == 0) {
            CHECK_OK(kvroute_router_resync_stream(r, str(step, "endpoint"), (uint64_t)num(step, "now_ms", 0)));
        } else if (strcmp(op, "events") == 0) {
            step_events(r, step, at);
        } else if (strcmp(op, "complete") == 0) {
            kvroute_result res = kvroute_router_complete(r, str(step, "request_id"));
            const cJSON *ee = cJSON_GetObjectItemCaseSensitive(step, "expect_error");
            kvroute_result want = ee ? KVROUTE_RESULT_UNKNOWN_REQUEST : KVROUTE_RESULT_OK;
            if (ee && strcmp(str(ee, "kind"), "unknown_request") != 0) want = -1;
            g_checks++;
            if (res != want) FAIL("%s: complete gave %s, expected %s", at, code_name(res), code_name(want));
        } else if (strcmp(op, "route") == 0) {
            step_route(r, step, at);
        } else {
            FAIL("%s: unknown op %s", at, op);
        }
    }
    kvroute_router_free(r);
    cJSON_Delete(c);
}

static int compare_names(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int main(int argc, char **argv) {
    if (argc != 2 && argc != 3) {
        fprintf(stderr, "usage: %s FIXTURES_DIR [NATIVE_DECISIONS]\n", argv[0]);
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
    CHECK(n >= 40);
    const char *rules[] = {"decode_direct",   "colocated_fast_path",     "disaggregated", "transfer_tax_veto",
                           "no_prefill_pool", "disaggregation_disabled", "shed"};
    int covered[7] = {0};
    for (size_t i = 0; i < n; i++) {
        run_case(files[i]);
        char *text = read_file(files[i], NULL);
        for (int k = 0; text && k < 7; k++) {
            char needle[64];
            snprintf(needle, sizeof needle, "\"rule\": \"%s\"", rules[k]);
            if (strstr(text, needle)) covered[k] = 1;
        }
        free(text);
        free(files[i]);
    }
    for (int k = 0; k < 7; k++) {
        snprintf(g_case, sizeof g_case, "coverage");
        g_checks++;
        if (!covered[k]) FAIL("rule %s has no expectation", rules[k]);
    }
    if (g_native != NULL) {
        snprintf(g_case, sizeof g_case, "native decisions");
        g_checks++;
        if (g_native_compared != g_native_len) {
            FAIL("%zu of %zu native decisions were compared", g_native_compared, g_native_len);
        }
        for (size_t i = 0; i < g_native_len; i++) {
            free(g_native[i].key);
            free(g_native[i].value);
        }
        free(g_native);
        printf("golden: %zu decisions equal the native Rust ones byte for byte\n", g_native_compared);
    }
    printf("golden: %zu cases replayed\n", n);
    return finish("golden");
}
