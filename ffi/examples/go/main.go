// Command route routes a request with libkvroute through cgo and prints the decision: the Go
// counterpart of ffi/examples/route.c.
//
// Build and run against the build tree (from the repository root):
//
//	cargo build --release -p kvroute-ffi
//	export PKG_CONFIG_PATH=$PWD/target/release LD_LIBRARY_PATH=$PWD/target/release
//	(cd ffi/examples/go && go run .)
//
// It exits 0 when both routes succeeded and the repeated request went where the first one did,
// and when flow control held a second request until the first completed (admit, ticket,
// release).
package main

/*
#cgo pkg-config: kvroute
#include <stdlib.h>
#include "kvroute.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strings"
	"unsafe"
)

// Error is a failed libkvroute call: its result code and the library's message.
type Error struct {
	Code    int32
	Message string
}

func (e *Error) Error() string {
	return fmt.Sprintf("%s: %s", C.GoString(C.kvroute_result_name(C.kvroute_result(e.Code))), e.Message)
}

// check turns a result code into an error carrying this thread's last error message. cgo calls
// may move between OS threads, so the message is read on the same locked thread by the caller
// (main locks it; see main).
func check(r C.kvroute_result) error {
	if r == C.KVROUTE_RESULT_OK {
		return nil
	}
	var buf [1024]C.char
	msg := ""
	if C.kvroute_last_error_message(&buf[0], C.size_t(len(buf)), nil) == C.KVROUTE_RESULT_OK {
		msg = C.GoString(&buf[0])
	}
	return &Error{Code: int32(r), Message: msg}
}

// copyOut runs a "strings out" accessor twice: a size query, then the copy. ABSENT gives "".
func copyOut(get func(buf *C.char, n C.size_t, needed *C.size_t) C.kvroute_result) (string, error) {
	var need C.size_t
	r := get(nil, 0, &need)
	if r == C.KVROUTE_RESULT_ABSENT {
		return "", nil
	}
	if r != C.KVROUTE_RESULT_BUFFER_TOO_SMALL {
		return "", check(r)
	}
	buf := (*C.char)(C.malloc(need))
	defer C.free(unsafe.Pointer(buf))
	if err := check(get(buf, need, nil)); err != nil {
		return "", err
	}
	return C.GoString(buf), nil
}

// Router owns a kvroute_router.
type Router struct{ p *C.kvroute_router }

// NewRouter creates a router from a JSON (or YAML) policy document.
func NewRouter(policy string) (*Router, error) {
	cs := C.CString(policy)
	defer C.free(unsafe.Pointer(cs))
	var r *C.kvroute_router
	if err := check(C.kvroute_router_new(cs, C.size_t(len(policy)), &r)); err != nil {
		return nil, err
	}
	return &Router{r}, nil
}

// Close frees the router.
func (r *Router) Close() { C.kvroute_router_free(r.p); r.p = nil }

// AddEndpoint registers a decode endpoint and its metrics.
func (r *Router) AddEndpoint(id string, waiting uint32, kvUsage float64, nowMs uint64) error {
	cid := C.CString(id)
	defer C.free(unsafe.Pointer(cid))
	if err := check(C.kvroute_router_upsert_endpoint(r.p, cid, C.KVROUTE_ROLE_DECODE)); err != nil {
		return err
	}
	var m C.kvroute_metrics // zero value: the optional fields are unset
	m.waiting = C.uint32_t(waiting)
	m.running = 4
	m.kv_usage = C.double(kvUsage)
	m.updated_ms = C.uint64_t(nowMs)
	return check(C.kvroute_router_update_metrics(r.p, cid, &m))
}

// cRequest is a request body and headers copied to C memory: cgo forbids passing C a Go array
// that holds Go pointers. Free it with free.
type cRequest struct {
	body    *C.char
	bodyLen C.size_t
	headers *[64]C.kvroute_header
	n       C.size_t
}

func newCRequest(body string, headers map[string]string) (*cRequest, error) {
	if len(headers) > 64 {
		return nil, errors.New("too many headers")
	}
	q := &cRequest{body: C.CString(body), bodyLen: C.size_t(len(body))}
	q.headers = (*[64]C.kvroute_header)(C.malloc(C.size_t(unsafe.Sizeof(C.kvroute_header{})) * 64))
	for k, v := range headers {
		h := &q.headers[q.n]
		h.name, h.name_len = C.CString(k), C.size_t(len(k))
		h.value, h.value_len = C.CString(v), C.size_t(len(v))
		q.n++
	}
	return q, nil
}

func (q *cRequest) free() {
	for i := C.size_t(0); i < q.n; i++ {
		C.free(unsafe.Pointer(q.headers[i].name))
		C.free(unsafe.Pointer(q.headers[i].value))
	}
	C.free(unsafe.Pointer(q.headers))
	C.free(unsafe.Pointer(q.body))
}

// Route routes one request body with headers.
func (r *Router) Route(body string, headers map[string]string, nowMs uint64) (*Decision, error) {
	q, err := newCRequest(body, headers)
	if err != nil {
		return nil, err
	}
	defer q.free()
	var d *C.kvroute_decision
	if err := check(C.kvroute_router_route(r.p, q.body, q.bodyLen, &q.headers[0], q.n, C.uint64_t(nowMs), &d)); err != nil {
		return nil, err
	}
	return &Decision{d}, nil
}

// Admit asks flow control about a request before routing it: admit now, a ticket to wait for,
// or a rejection (status and x-llm-d-request-dropped-reason value).
func (r *Router) Admit(body string, headers map[string]string, nowMs uint64) (C.kvroute_admission, error) {
	var a C.kvroute_admission
	q, err := newCRequest(body, headers)
	if err != nil {
		return a, err
	}
	defer q.free()
	err = check(C.kvroute_router_admit(r.p, q.body, q.bodyLen, &q.headers[0], q.n, C.uint64_t(nowMs), &a))
	return a, err
}

// TakeReleases makes a dispatch opportunity and returns every release made since the last call
// (taking again while the router says some remain: nothing is lost when the buffer is small).
func (r *Router) TakeReleases(nowMs uint64) ([]C.kvroute_release, error) {
	var out []C.kvroute_release
	var buf [16]C.kvroute_release
	for {
		var n, remaining C.size_t
		if err := check(C.kvroute_router_take_releases(r.p, C.uint64_t(nowMs), &buf[0], C.size_t(len(buf)), &n, &remaining)); err != nil {
			return out, err
		}
		out = append(out, buf[:n]...)
		if remaining == 0 {
			return out, nil
		}
	}
}

// Complete releases a finished request's in-flight counters.
func (r *Router) Complete(requestID string) error {
	cid := C.CString(requestID)
	defer C.free(unsafe.Pointer(cid))
	return check(C.kvroute_router_complete(r.p, cid))
}

// Decision owns a kvroute_decision.
type Decision struct{ p *C.kvroute_decision }

// Close frees the decision.
func (d *Decision) Close() { C.kvroute_decision_free(d.p); d.p = nil }

func (d *Decision) text(get func(*C.kvroute_decision, *C.char, C.size_t, *C.size_t) C.kvroute_result) (string, error) {
	return copyOut(func(buf *C.char, n C.size_t, need *C.size_t) C.kvroute_result { return get(d.p, buf, n, need) })
}

// RequestID is the id to pass to Complete.
func (d *Decision) RequestID() (string, error) {
	return d.text(func(p *C.kvroute_decision, b *C.char, n C.size_t, need *C.size_t) C.kvroute_result {
		return C.kvroute_decision_request_id(p, b, n, need)
	})
}

// Endpoint is the target endpoint ("" when shed).
func (d *Decision) Endpoint() (string, error) {
	return d.text(func(p *C.kvroute_decision, b *C.char, n C.size_t, need *C.size_t) C.kvroute_result {
		return C.kvroute_decision_endpoint(p, b, n, need)
	})
}

// PrefillEndpoint is the prefill endpoint ("" unless disaggregated).
func (d *Decision) PrefillEndpoint() (string, error) {
	return d.text(func(p *C.kvroute_decision, b *C.char, n C.size_t, need *C.size_t) C.kvroute_result {
		return C.kvroute_decision_prefill_endpoint(p, b, n, need)
	})
}

// Headers are the headers to set on the upstream request, in order.
func (d *Decision) Headers() ([][2]string, error) {
	var out [][2]string
	for i := C.size_t(0); i < C.kvroute_decision_header_count(d.p); i++ {
		name, err := d.text(func(p *C.kvroute_decision, b *C.char, n C.size_t, need *C.size_t) C.kvroute_result {
			return C.kvroute_decision_header_name(p, i, b, n, need)
		})
		if err != nil {
			return nil, err
		}
		value, err := d.text(func(p *C.kvroute_decision, b *C.char, n C.size_t, need *C.size_t) C.kvroute_result {
			return C.kvroute_decision_header_value(p, i, b, n, need)
		})
		if err != nil {
			return nil, err
		}
		out = append(out, [2]string{name, value})
	}
	return out, nil
}

func name(p *C.char) string {
	if p == nil {
		return "-"
	}
	return C.GoString(p)
}

func (d *Decision) print() error {
	id, err := d.RequestID()
	if err != nil {
		return err
	}
	ep, err := d.Endpoint()
	if err != nil {
		return err
	}
	prefill, err := d.PrefillEndpoint()
	if err != nil {
		return err
	}
	headers, err := d.Headers()
	if err != nil {
		return err
	}
	fmt.Printf("  request id:       %s\n", id)
	fmt.Printf("  mode:             %s\n", name(C.kvroute_mode_name(C.kvroute_decision_mode(d.p))))
	fmt.Printf("  rule:             %s\n", name(C.kvroute_rule_name(C.kvroute_decision_rule(d.p))))
	fmt.Printf("  endpoint:         %s\n", ep)
	fmt.Printf("  prefill endpoint: %s\n", map[bool]string{true: "-", false: prefill}[prefill == ""])
	fmt.Printf("  policy version:   %d\n", uint64(C.kvroute_decision_policy_version(d.p)))
	fmt.Printf("  prefix hit:       %.2f\n", float64(C.kvroute_decision_prefix_hit(d.p)))
	fmt.Printf("  headers:\n")
	for _, h := range headers {
		fmt.Printf("    %s: %s\n", h[0], h[1])
	}
	fmt.Printf("  scores:\n")
	for i := C.size_t(0); i < C.kvroute_decision_score_count(d.p); i++ {
		ep, err := d.text(func(p *C.kvroute_decision, b *C.char, n C.size_t, need *C.size_t) C.kvroute_result {
			return C.kvroute_decision_score_endpoint(p, i, b, n, need)
		})
		if err != nil {
			return err
		}
		var s C.kvroute_endpoint_score
		if err := check(C.kvroute_decision_score(d.p, i, &s)); err != nil {
			return err
		}
		fmt.Printf("    %-15s total %.3f (prefix hit %.2f, queue %.2f, kv usage %.2f)\n", ep,
			float64(s.total), float64(s.prefix_hit), float64(s.queue), float64(s.kv_usage))
	}
	return nil
}

// flowControl holds a second request in the router's queue while the only slot is busy, and
// releases it when the first completes: the call protocol a gateway follows.
func flowControl(now uint64) error {
	router, err := NewRouter(`{"flow_control": {"enabled": true, "saturation_detector": ` +
		`{"kind": "concurrency", "max_requests_per_endpoint": 1}}}`)
	if err != nil {
		return err
	}
	defer router.Close()
	cid := C.CString("10.0.0.1:8000")
	defer C.free(unsafe.Pointer(cid))
	if err := check(C.kvroute_router_upsert_endpoint(router.p, cid, C.KVROUTE_ROLE_DECODE)); err != nil {
		return err
	}
	body := `{"model":"llama","prompt":"hello","max_tokens":16}`
	tenant := map[string]string{"x-llm-d-inference-fairness-id": "tenant-a"}
	first, err := router.Admit(body, tenant, now)
	if err != nil {
		return err
	}
	if first.kind != C.KVROUTE_ADMISSION_ADMIT {
		return fmt.Errorf("the first request was %s, not admitted", name(C.kvroute_admission_kind_name(first.kind)))
	}
	d, err := router.Route(body, tenant, now)
	if err != nil {
		return err
	}
	firstID, err := d.RequestID()
	d.Close()
	if err != nil {
		return err
	}
	second, err := router.Admit(body, tenant, now+1)
	if err != nil {
		return err
	}
	if second.kind != C.KVROUTE_ADMISSION_QUEUED {
		return fmt.Errorf("the second request was %s, not queued", name(C.kvroute_admission_kind_name(second.kind)))
	}
	if rs, err := router.TakeReleases(now + 2); err != nil || len(rs) != 0 {
		return fmt.Errorf("released while the slot is busy: %v %v", rs, err)
	}
	if err := router.Complete(firstID); err != nil {
		return err
	}
	rs, err := router.TakeReleases(now + 5)
	if err != nil {
		return err
	}
	if len(rs) != 1 || rs[0].ticket != second.ticket || rs[0].outcome != C.KVROUTE_RELEASE_DISPATCHED {
		return fmt.Errorf("expected ticket %d dispatched, got %v", uint64(second.ticket), rs)
	}
	d, err = router.Route(body, tenant, now+5)
	if err != nil {
		return err
	}
	secondID, err := d.RequestID()
	d.Close()
	if err != nil {
		return err
	}
	fmt.Printf("flow control: queued ticket %d, %s after %d ms\n", uint64(second.ticket),
		name(C.kvroute_release_outcome_name(rs[0].outcome)), uint64(rs[0].waited_ms))
	return router.Complete(secondID)
}

func run() error {
	fmt.Printf("libkvroute %s (from Go)\n", C.GoString(C.kvroute_version()))
	router, err := NewRouter(`{"metrics": {"staleness_ms": 60000}}`)
	if err != nil {
		return err
	}
	defer router.Close()
	now := uint64(C.kvroute_now_ms())
	for i, ep := range []string{"10.0.0.1:8000", "10.0.0.2:8000"} {
		if err := router.AddEndpoint(ep, uint32(i), 0.25, now); err != nil {
			return err
		}
	}
	system := strings.Repeat("You are a careful assistant; cite the documents you were given. ", 60)
	body := fmt.Sprintf(`{"model":"llama","max_tokens":512,"messages":[{"role":"system","content":%q},`+
		`{"role":"user","content":"What changed in the last release?"}]}`, system)
	var targets []string
	for round := 1; round <= 2; round++ {
		d, err := router.Route(body, map[string]string{"x-session-id": "session-42"}, now+uint64(round))
		if err != nil {
			return err
		}
		fmt.Printf("decision %d:\n", round)
		if err := d.print(); err != nil {
			d.Close()
			return err
		}
		ep, _ := d.Endpoint()
		targets = append(targets, ep)
		id, err := d.RequestID()
		d.Close()
		if err != nil {
			return err
		}
		if err := router.Complete(id); err != nil {
			return err
		}
	}
	if targets[0] != targets[1] {
		return fmt.Errorf("the repeated request went to %s, not to %s where its prefix is cached", targets[1], targets[0])
	}
	// Bad input is a typed error, never a crash.
	if _, err := router.Route(`{"prompt": 1}`, nil, now); err == nil {
		return errors.New("a malformed body was routed")
	} else {
		var e *Error
		if !errors.As(err, &e) || e.Code != C.KVROUTE_RESULT_REQUEST_ERROR {
			return fmt.Errorf("a malformed body gave %v, expected KVROUTE_RESULT_REQUEST_ERROR", err)
		}
		fmt.Printf("malformed body: %v\n", err)
	}
	return flowControl(now)
}

func main() {
	// The last error is per OS thread: keep this goroutine on one thread so that a failed call
	// and the read of its message happen on the same thread.
	runtime.LockOSThread()
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}
