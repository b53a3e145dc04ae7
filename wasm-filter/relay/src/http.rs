//! A minimal blocking HTTP/1.1 client over `std::net::TcpStream`: one keep-alive connection per
//! target, `POST` with a `Content-Length` body, responses read by `Content-Length` or chunked
//! encoding. It is all the relay needs (one request shape to one listener); plaintext only (put
//! TLS in the mesh or a sidecar, as the Envoy listener's own config decides).

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

/// Largest response body read (the filter's answers are small JSON documents).
const MAX_RESPONSE_BYTES: usize = 1 << 20;

/// An `http://host:port` target.
#[derive(Debug)]
pub struct Target {
    host: String,
    port: u16,
    authority: String,
    timeout: Duration,
    conn: Option<BufReader<TcpStream>>,
}

/// A response: status and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// Body.
    pub body: Vec<u8>,
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

impl Target {
    /// Parse `http://host:port` (`[v6]:port` accepted; port defaults to 80).
    pub fn parse(url: &str, timeout: Duration) -> Result<Target, String> {
        let rest = url.strip_prefix("http://").ok_or_else(|| format!("{url:?}: only http:// targets are supported"))?;
        let authority = rest.trim_end_matches('/');
        if authority.is_empty() || authority.contains('/') {
            return Err(format!("{url:?}: expected http://host:port (the path is configured separately)"));
        }
        let port_of = |p: &str| p.parse::<u16>().map_err(|_| format!("{url:?}: bad port {p:?}"));
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (h, rest) = v6.split_once(']').ok_or_else(|| format!("{url:?}: unterminated [ipv6]"))?;
            match rest.strip_prefix(':') {
                Some(p) => (h.to_owned(), port_of(p)?),
                None if rest.is_empty() => (h.to_owned(), 80),
                None => return Err(format!("{url:?}: bad authority")),
            }
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (h.to_owned(), port_of(p)?),
                None => (authority.to_owned(), 80),
            }
        };
        Ok(Target { host, port, authority: authority.to_owned(), timeout, conn: None })
    }

    /// The `host:port` this target connects to.
    pub fn authority(&self) -> &str {
        &self.authority
    }

    fn connect(&self) -> io::Result<BufReader<TcpStream>> {
        let mut last = bad("no address");
        for addr in (self.host.as_str(), self.port).to_socket_addrs()? {
            match TcpStream::connect_timeout(&addr, self.timeout) {
                Ok(s) => {
                    s.set_read_timeout(Some(self.timeout))?;
                    s.set_write_timeout(Some(self.timeout))?;
                    s.set_nodelay(true)?;
                    return Ok(BufReader::new(s));
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// `POST path` with `headers` and `body`. A kept-alive connection that turns out closed is
    /// replaced once; any other error drops the connection and is returned.
    pub fn post(&mut self, path: &str, headers: &[(&str, &str)], body: &[u8]) -> io::Result<Response> {
        let reused = self.conn.is_some();
        match self.post_once(path, headers, body) {
            Ok(r) => Ok(r),
            Err(_) if reused => {
                self.conn = None;
                self.post_once(path, headers, body)
            }
            Err(e) => Err(e),
        }
    }

    fn post_once(&mut self, path: &str, headers: &[(&str, &str)], body: &[u8]) -> io::Result<Response> {
        if self.conn.is_none() {
            self.conn = Some(self.connect()?);
        }
        let result = self.exchange(path, headers, body);
        if result.is_err() {
            self.conn = None;
        }
        result
    }

    fn exchange(&mut self, path: &str, headers: &[(&str, &str)], body: &[u8]) -> io::Result<Response> {
        let conn = self.conn.as_mut().ok_or_else(|| bad("not connected"))?;
        let mut head = format!(
            "POST {path} HTTP/1.1\r\nhost: {}\r\ncontent-length: {}\r\ncontent-type: application/msgpack\r\n",
            self.authority,
            body.len()
        );
        for (k, v) in headers {
            if k.contains(['\r', '\n', ':']) || v.contains(['\r', '\n']) {
                return Err(bad(format!("header {k:?} cannot be sent")));
            }
            head.push_str(k);
            head.push_str(": ");
            head.push_str(v);
            head.push_str("\r\n");
        }
        head.push_str("\r\n");
        let stream = conn.get_mut();
        stream.write_all(head.as_bytes())?;
        stream.write_all(body)?;
        stream.flush()?;
        let (resp, keep) = read_response(conn)?;
        if !keep {
            self.conn = None;
        }
        Ok(resp)
    }
}

/// Read one response; returns it and whether the connection may be reused.
pub fn read_response(r: &mut impl BufRead) -> io::Result<(Response, bool)> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed"));
    }
    let mut parts = line.split_whitespace();
    let version = parts.next().unwrap_or("");
    if !version.starts_with("HTTP/1.") {
        return Err(bad(format!("not an HTTP/1.x status line: {line:?}")));
    }
    let status = parts.next().and_then(|s| s.parse::<u16>().ok()).ok_or_else(|| bad("bad status"))?;
    let (mut length, mut chunked, mut keep) = (None, false, version == "HTTP/1.1");
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "headers cut short"));
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        let Some((k, v)) = l.split_once(':') else { return Err(bad(format!("bad header line {l:?}"))) };
        let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
        match k.as_str() {
            "content-length" => length = Some(v.parse::<usize>().map_err(|_| bad("bad content-length"))?),
            "transfer-encoding" => chunked = v.eq_ignore_ascii_case("chunked"),
            "connection" => keep = !v.eq_ignore_ascii_case("close"),
            _ => {}
        }
    }
    let mut body = Vec::new();
    if chunked {
        loop {
            line.clear();
            r.read_line(&mut line)?;
            let size_text = line.trim().split(';').next().unwrap_or("");
            let size = usize::from_str_radix(size_text, 16).map_err(|_| bad("bad chunk size"))?;
            if body.len() + size > MAX_RESPONSE_BYTES {
                return Err(bad("response too large"));
            }
            let start = body.len();
            body.resize(start + size, 0);
            r.read_exact(&mut body[start..])?;
            line.clear();
            r.read_line(&mut line)?;
            if size == 0 {
                break;
            }
        }
    } else if let Some(n) = length {
        if n > MAX_RESPONSE_BYTES {
            return Err(bad("response too large"));
        }
        body.resize(n, 0);
        r.read_exact(&mut body)?;
    } else if status >= 200 && status != 204 && status != 304 {
        // Delimited by the connection's end.
        r.take(MAX_RESPONSE_BYTES as u64).read_to_end(&mut body)?;
        keep = false;
    }
    Ok((Response { status, body }, keep))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn targets() {
        let t = Target::parse("http://127.0.0.1:10000", Duration::from_secs(1)).unwrap();
        assert_eq!((t.host.as_str(), t.port, t.authority()), ("127.0.0.1", 10000, "127.0.0.1:10000"));
        let t = Target::parse("http://[::1]:8080/", Duration::from_secs(1)).unwrap();
        assert_eq!((t.host.as_str(), t.port), ("::1", 8080));
        assert_eq!(Target::parse("http://envoy", Duration::from_secs(1)).unwrap().port, 80);
        assert!(Target::parse("https://x:1", Duration::from_secs(1)).is_err());
        assert!(Target::parse("http://x:1/path", Duration::from_secs(1)).is_err());
        assert!(Target::parse("http://x:notaport", Duration::from_secs(1)).is_err());
    }

    #[test]
    fn responses() {
        let mut r = &b"HTTP/1.1 409 Conflict\r\ncontent-length: 5\r\n\r\nhello"[..];
        assert_eq!(read_response(&mut r).unwrap(), (Response { status: 409, body: b"hello".to_vec() }, true));
        let mut r = &b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"[..];
        assert_eq!(read_response(&mut r).unwrap(), (Response { status: 200, body: b"abcde".to_vec() }, false));
        let mut r = &b"SSH-2.0\r\n"[..];
        assert!(read_response(&mut r).is_err());
        let mut r = &b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort"[..];
        assert!(read_response(&mut r).is_err());
    }
}
