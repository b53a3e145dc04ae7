//! A minimal blocking HTTP/1.1 client for loopback workers: `GET` for `/metrics`, streaming
//! `POST` for completions with server-sent events (chunked or length-delimited bodies). One
//! connection per request (`Connection: close`), so nothing is pooled or shared between threads.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// Errors of one HTTP exchange.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HttpError {
    /// Socket error.
    #[error("{addr}: {source}")]
    Io {
        /// Peer.
        addr: SocketAddr,
        /// Cause.
        source: std::io::Error,
    },
    /// The response is not valid HTTP/1.x.
    #[error("{addr}: malformed response: {what}")]
    Malformed {
        /// Peer.
        addr: SocketAddr,
        /// What is wrong.
        what: String,
    },
    /// Non-2xx status.
    #[error("{addr}: HTTP {status}: {body}")]
    Status {
        /// Peer.
        addr: SocketAddr,
        /// Status code.
        status: u16,
        /// Start of the body.
        body: String,
    },
}

/// Largest response body kept in memory (non-streaming).
const MAX_BODY: usize = 16 << 20;
/// Longest header line accepted.
const MAX_LINE: usize = 64 << 10;

fn io(addr: SocketAddr) -> impl Fn(std::io::Error) -> HttpError {
    move |source| HttpError::Io { addr, source }
}

fn malformed(addr: SocketAddr, what: impl Into<String>) -> HttpError {
    HttpError::Malformed { addr, what: what.into() }
}

fn connect(addr: SocketAddr, timeout: Duration) -> Result<TcpStream, HttpError> {
    let s = TcpStream::connect_timeout(&addr, timeout).map_err(io(addr))?;
    s.set_read_timeout(Some(timeout)).map_err(io(addr))?;
    s.set_write_timeout(Some(timeout)).map_err(io(addr))?;
    s.set_nodelay(true).map_err(io(addr))?;
    Ok(s)
}

fn read_line(r: &mut impl BufRead, addr: SocketAddr, line: &mut Vec<u8>) -> Result<(), HttpError> {
    line.clear();
    let n = r.take(MAX_LINE as u64).read_until(b'\n', line).map_err(io(addr))?;
    if n == 0 {
        return Err(malformed(addr, "connection closed early"));
    }
    while line.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
        line.pop();
    }
    Ok(())
}

enum Framing {
    Chunked,
    Length(usize),
    UntilClose,
}

/// Status line and headers; returns the status and how the body is framed.
fn read_head(r: &mut impl BufRead, addr: SocketAddr) -> Result<(u16, Framing), HttpError> {
    let mut line = Vec::new();
    read_line(r, addr, &mut line)?;
    let text = String::from_utf8_lossy(&line);
    let mut parts = text.split_whitespace();
    let version = parts.next().unwrap_or_default();
    if !version.starts_with("HTTP/1.") {
        return Err(malformed(addr, format!("status line {text:?}")));
    }
    let status: u16 =
        parts.next().and_then(|s| s.parse().ok()).ok_or_else(|| malformed(addr, format!("status line {text:?}")))?;
    let mut framing = Framing::UntilClose;
    loop {
        read_line(r, addr, &mut line)?;
        if line.is_empty() {
            break;
        }
        let h = String::from_utf8_lossy(&line);
        let Some((name, value)) = h.split_once(':') else { continue };
        let (name, value) = (name.trim(), value.trim());
        if name.eq_ignore_ascii_case("transfer-encoding") && value.to_ascii_lowercase().contains("chunked") {
            framing = Framing::Chunked;
        } else if name.eq_ignore_ascii_case("content-length") && !matches!(framing, Framing::Chunked) {
            let n = value.parse().map_err(|_| malformed(addr, format!("content-length {value:?}")))?;
            framing = Framing::Length(n);
        }
    }
    Ok((status, framing))
}

/// Feed the body to `sink` piece by piece as it arrives; `sink` returns `false` to stop early.
fn read_body(
    r: &mut impl BufRead,
    addr: SocketAddr,
    framing: Framing,
    mut sink: impl FnMut(&[u8]) -> bool,
) -> Result<(), HttpError> {
    let mut buf = vec![0u8; 16 << 10];
    match framing {
        Framing::Length(mut left) => {
            while left > 0 {
                let want = left.min(buf.len());
                let n = r.read(&mut buf[..want]).map_err(io(addr))?;
                if n == 0 {
                    return Err(malformed(addr, "body shorter than content-length"));
                }
                left -= n;
                if !sink(&buf[..n]) {
                    return Ok(());
                }
            }
        }
        Framing::UntilClose => loop {
            let n = r.read(&mut buf).map_err(io(addr))?;
            if n == 0 || !sink(&buf[..n]) {
                return Ok(());
            }
        },
        Framing::Chunked => {
            let mut line = Vec::new();
            loop {
                read_line(r, addr, &mut line)?;
                let text = String::from_utf8_lossy(&line);
                let size_text = text.split(';').next().unwrap_or_default().trim();
                let mut left = usize::from_str_radix(size_text, 16)
                    .map_err(|_| malformed(addr, format!("chunk size {size_text:?}")))?;
                if left == 0 {
                    return Ok(());
                }
                while left > 0 {
                    let want = left.min(buf.len());
                    let n = r.read(&mut buf[..want]).map_err(io(addr))?;
                    if n == 0 {
                        return Err(malformed(addr, "connection closed inside a chunk"));
                    }
                    left -= n;
                    if !sink(&buf[..n]) {
                        return Ok(());
                    }
                }
                read_line(r, addr, &mut line)?;
            }
        }
    }
    Ok(())
}

/// `GET path`; the body of a 2xx response.
pub(crate) fn get(addr: SocketAddr, path: &str, timeout: Duration) -> Result<Vec<u8>, HttpError> {
    let mut s = connect(addr, timeout)?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nAccept: */*\r\n\r\n");
    s.write_all(req.as_bytes()).map_err(io(addr))?;
    let mut r = BufReader::new(s);
    let (status, framing) = read_head(&mut r, addr)?;
    let mut body = Vec::new();
    read_body(&mut r, addr, framing, |b| {
        body.extend_from_slice(b);
        body.len() < MAX_BODY
    })?;
    if !(200..300).contains(&status) {
        return Err(HttpError::Status {
            addr,
            status,
            body: String::from_utf8_lossy(&body).chars().take(300).collect(),
        });
    }
    Ok(body)
}

/// `POST path` with a JSON body and extra headers, reading a server-sent-event stream: `on_event`
/// gets the payload of every `data:` line as it arrives and returns `false` to stop reading.
/// A non-2xx status is an error carrying the start of the body.
pub(crate) fn post_sse(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
    mut on_event: impl FnMut(&[u8]) -> bool,
) -> Result<(), HttpError> {
    let mut s = connect(addr, timeout)?;
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Accept: text/event-stream\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(k);
        head.push_str(": ");
        head.push_str(v);
        head.push_str("\r\n");
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).map_err(io(addr))?;
    s.write_all(body).map_err(io(addr))?;
    let mut r = BufReader::new(s);
    let (status, framing) = read_head(&mut r, addr)?;
    if !(200..300).contains(&status) {
        let mut text = Vec::new();
        read_body(&mut r, addr, framing, |b| {
            text.extend_from_slice(b);
            text.len() < 4096
        })?;
        return Err(HttpError::Status {
            addr,
            status,
            body: String::from_utf8_lossy(&text).chars().take(300).collect(),
        });
    }
    let mut pending: Vec<u8> = Vec::new();
    let mut go_on = true;
    read_body(&mut r, addr, framing, |piece| {
        pending.extend_from_slice(piece);
        // Every complete line: `data: ...` lines are events (single-line JSON payloads).
        let mut start = 0;
        while let Some(nl) = pending[start..].iter().position(|&b| b == b'\n') {
            let mut line = &pending[start..start + nl];
            start += nl + 1;
            if line.last() == Some(&b'\r') {
                line = &line[..line.len() - 1];
            }
            if let Some(data) = line.strip_prefix(b"data:") {
                let data = data.strip_prefix(b" ").unwrap_or(data);
                if !on_event(data) {
                    go_on = false;
                    break;
                }
            }
        }
        pending.drain(..start);
        go_on
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn serve_once(response: &'static [u8]) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            if let Ok((mut s, _)) = l.accept() {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf);
                let _ = s.write_all(response);
            }
        });
        addr
    }

    #[test]
    fn chunked_sse_events_are_split_across_chunks() {
        let addr = serve_once(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n\
              9\r\ndata: {\"a\r\n6\r\n\":1}\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n",
        );
        let mut events = Vec::new();
        post_sse(addr, "/v1/completions", &[("x-a", "b")], b"{}", Duration::from_secs(5), |e| {
            events.push(String::from_utf8_lossy(e).into_owned());
            true
        })
        .unwrap();
        assert_eq!(events, vec!["{\"a\":1}".to_owned(), "[DONE]".to_owned()]);
    }

    #[test]
    fn errors_carry_status_and_body() {
        let addr = serve_once(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 5\r\n\r\nnope!");
        let err = post_sse(addr, "/x", &[], b"{}", Duration::from_secs(5), |_| true).unwrap_err();
        assert!(matches!(err, HttpError::Status { status: 400, ref body, .. } if body == "nope!"), "{err}");
        let addr = serve_once(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nok\n\n");
        assert_eq!(get(addr, "/metrics", Duration::from_secs(5)).unwrap(), b"ok\n\n");
        let addr = serve_once(b"garbage\r\n\r\n");
        assert!(matches!(get(addr, "/", Duration::from_secs(5)), Err(HttpError::Malformed { .. })));
    }
}
