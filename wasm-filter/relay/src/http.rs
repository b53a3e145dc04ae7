//! The relay's HTTP/1.1 client: a [`ureq::Agent`] per target (its connection pool keeps the
//! connection alive between POSTs), `POST` with a `Content-Length` body, the response read up to
//! [`MAX_RESPONSE_BYTES`]. Plaintext `http://` only: put TLS in the mesh or a sidecar, as the
//! Envoy listener's own config decides.
//!
//! The agent sends only what the relay asks for: no proxy from the environment, no redirects
//! followed, no `user-agent`, `accept` or `accept-encoding` headers, and every status comes back
//! as a [`Response`] (the forwarder decides what 2xx, 409 and the others mean).

use std::time::Duration;

use ureq::config::AutoHeaderValue;
use ureq::http::uri::Authority;
use ureq::Agent;

/// Largest response body read (the filter's answers are small JSON documents).
pub const MAX_RESPONSE_BYTES: u64 = 1 << 20;
/// Largest body a `GET` reads (the filter's replica export: at most its `max_batch_bytes`,
/// 64 MiB).
pub const MAX_GET_BYTES: u64 = 65 << 20;

/// An `http://host:port` target.
#[derive(Debug)]
pub struct Target {
    /// `http://host:port`, the request path appended.
    base: String,
    authority: String,
    agent: Agent,
}

/// A response: status and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// Body.
    pub body: Vec<u8>,
}

impl Target {
    /// Parse `http://host:port` (`[v6]:port` accepted; port defaults to 80). `timeout` bounds
    /// connecting and every read and write.
    pub fn parse(url: &str, timeout: Duration) -> Result<Target, String> {
        let rest = url.strip_prefix("http://").ok_or_else(|| format!("{url:?}: only http:// targets are supported"))?;
        let authority = rest.trim_end_matches('/');
        if authority.is_empty() || authority.contains(['/', '?', '#', '@']) {
            return Err(format!("{url:?}: expected http://host:port (the path is configured separately)"));
        }
        let parsed: Authority = authority.parse().map_err(|e| format!("{url:?}: bad authority: {e}"))?;
        // `Authority` keeps a port it cannot read: check it here.
        let port = &authority[parsed.host().len()..];
        if let Some(p) = port.strip_prefix(':') {
            p.parse::<u16>().map_err(|_| format!("{url:?}: bad port {p:?}"))?;
        } else if !port.is_empty() {
            return Err(format!("{url:?}: bad authority"));
        }
        let config = Agent::config_builder()
            .http_status_as_error(false)
            .proxy(None)
            .max_redirects(0)
            .user_agent(AutoHeaderValue::None)
            .accept(AutoHeaderValue::None)
            .accept_encoding(AutoHeaderValue::None)
            .timeout_connect(Some(timeout))
            .timeout_per_read(Some(timeout))
            .timeout_per_write(Some(timeout))
            .build();
        Ok(Target { base: format!("http://{authority}"), authority: authority.to_owned(), agent: config.into() })
    }

    /// The `host:port` this target connects to.
    pub fn authority(&self) -> &str {
        &self.authority
    }

    /// `POST path` with `headers` and `body` (`content-type: application/msgpack`). Any status is
    /// a [`Response`]; transport errors, a header that cannot be sent and a body over
    /// [`MAX_RESPONSE_BYTES`] are errors.
    pub fn post(&self, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Result<Response, ureq::Error> {
        let mut request = self.agent.post(format!("{}{path}", self.base)).content_type("application/msgpack");
        for (k, v) in headers {
            request = request.header(*k, *v);
        }
        let mut response = request.send(body)?;
        let status = response.status().as_u16();
        let body = response.body_mut().with_config().limit(MAX_RESPONSE_BYTES).read_to_vec()?;
        Ok(Response { status, body })
    }
}

/// A response with its headers (names lowercase).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetched {
    /// Status code.
    pub status: u16,
    /// Headers, names lowercase, in order.
    pub headers: Vec<(String, String)>,
    /// Body.
    pub body: Vec<u8>,
}

impl Fetched {
    /// The first value of header `name` (lowercase).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

impl Target {
    /// `GET path` with `headers`. Any status is a [`Fetched`]; transport errors, a header that
    /// cannot be sent and a body over [`MAX_GET_BYTES`] are errors.
    pub fn get(&self, path: &str, headers: &[(&str, &str)]) -> Result<Fetched, ureq::Error> {
        let mut request = self.agent.get(format!("{}{path}", self.base));
        for (k, v) in headers {
            request = request.header(*k, *v);
        }
        let mut response = request.call()?;
        let status = response.status().as_u16();
        let headers = response
            .headers()
            .iter()
            .map(|(k, v)| (k.as_str().to_ascii_lowercase(), String::from_utf8_lossy(v.as_bytes()).into_owned()))
            .collect();
        let body = response.body_mut().with_config().limit(MAX_GET_BYTES).read_to_vec()?;
        Ok(Fetched { status, headers, body })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::TcpListener;
    use std::sync::mpsc::{channel, Receiver};

    const T: Duration = Duration::from_secs(2);

    #[test]
    fn targets() {
        let t = Target::parse("http://127.0.0.1:10000", T).unwrap();
        assert_eq!((t.authority(), t.base.as_str()), ("127.0.0.1:10000", "http://127.0.0.1:10000"));
        assert_eq!(Target::parse("http://[::1]:8080/", T).unwrap().authority(), "[::1]:8080");
        assert_eq!(Target::parse("http://envoy", T).unwrap().authority(), "envoy");
        for bad in
            ["https://x:1", "http://x:1/path", "http://x:notaport", "http://x:99999", "http://[::1", "http://u@x:1"]
        {
            assert!(Target::parse(bad, T).is_err(), "{bad}");
        }
    }

    /// A request as the test server saw it: the number of its connection, its head (request
    /// line, then lowercased header lines) and its body.
    type Seen = (usize, Vec<String>, Vec<u8>);

    /// A loopback server answering each request on one connection with the next of `replies`
    /// (raw bytes); sends back every request it reads.
    fn server(replies: Vec<Vec<u8>>) -> (String, Receiver<Seen>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            let mut replies = replies.into_iter();
            for (n, conn) in listener.incoming().enumerate() {
                let Ok(conn) = conn else { return };
                let mut r = BufReader::new(conn.try_clone().unwrap());
                let mut w = conn;
                loop {
                    let mut head = Vec::new();
                    loop {
                        let mut line = String::new();
                        if r.read_line(&mut line).unwrap_or(0) == 0 {
                            break;
                        }
                        let line = line.trim_end().to_owned();
                        if line.is_empty() {
                            break;
                        }
                        head.push(if head.is_empty() { line } else { line.to_ascii_lowercase() });
                    }
                    if head.is_empty() {
                        break;
                    }
                    let len =
                        head.iter().find_map(|h| h.strip_prefix("content-length: ")).map_or(0, |v| v.parse().unwrap());
                    let mut body = vec![0; len];
                    r.read_exact(&mut body).unwrap();
                    let _ = tx.send((n, head, body));
                    let Some(reply) = replies.next() else { return };
                    if w.write_all(&reply).is_err() {
                        break;
                    }
                }
            }
        });
        (url, rx)
    }

    #[test]
    fn posts_keep_the_connection_and_return_every_status() {
        let replies = vec![
            b"HTTP/1.1 409 Conflict\r\ncontent-length: 5\r\n\r\nhello".to_vec(),
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n".to_vec(),
            b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\n\r\n".to_vec(),
        ];
        let (url, rx) = server(replies);
        let t = Target::parse(&url, T).unwrap();
        let r = t.post("/kvroute/v1/events", &[("x-kvroute-seq", "7")], b"payload").unwrap();
        assert_eq!(r, Response { status: 409, body: b"hello".to_vec() });
        let (conn, head, body) = rx.recv_timeout(T).unwrap();
        assert_eq!(head[0], "POST /kvroute/v1/events HTTP/1.1");
        let mut fields = head[1..].to_vec();
        fields.sort();
        let host = format!("host: {}", t.authority());
        assert_eq!(
            fields,
            ["content-length: 7", "content-type: application/msgpack", host.as_str(), "x-kvroute-seq: 7"]
        );
        assert_eq!((conn, body), (0, b"payload".to_vec()));

        let r = t.post("/kvroute/v1/events", &[], b"").unwrap();
        assert_eq!(r, Response { status: 200, body: b"abcde".to_vec() });
        let (conn, head, body) = rx.recv_timeout(T).unwrap();
        assert!(head.iter().any(|h| h == "content-length: 0"), "{head:?}");
        assert_eq!((conn, body), (0, Vec::new()));

        assert_eq!(t.post("/p", &[], b"x").unwrap().status, 401);
        assert_eq!(rx.recv_timeout(T).unwrap().0, 0, "one kept-alive connection");
    }

    #[test]
    fn a_closed_connection_is_replaced() {
        let replies = vec![
            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".to_vec(),
            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n".to_vec(),
        ];
        let (url, rx) = server(replies);
        let t = Target::parse(&url, T).unwrap();
        assert_eq!(t.post("/p", &[], b"a").unwrap().status, 200);
        assert_eq!(t.post("/p", &[], b"b").unwrap().status, 200);
        assert_eq!(rx.recv_timeout(T).unwrap().0, 0);
        assert_eq!(rx.recv_timeout(T).unwrap().0, 1);
    }

    #[test]
    fn errors_are_returned() {
        let too_large = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", MAX_RESPONSE_BYTES + 1).into_bytes();
        let mut large = too_large.clone();
        large.resize(too_large.len() + MAX_RESPONSE_BYTES as usize + 1, b'x');
        let (url, _rx) = server(vec![large, b"SSH-2.0\r\n".to_vec()]);
        let t = Target::parse(&url, T).unwrap();
        assert!(matches!(t.post("/p", &[], b""), Err(ureq::Error::BodyExceedsLimit(_))));
        assert!(t.post("/p", &[], b"").is_err());
        assert!(t.post("/p", &[("bad\r\nheader", "v")], b"").is_err());
        assert!(t.post("/p", &[("x-h", "a\r\nb")], b"").is_err());

        let dead = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        assert!(Target::parse(&format!("http://{dead}"), T).unwrap().post("/p", &[], b"").is_err());
    }
}
