//! The request id that follows a request through the logs of the router and the shards,
//! its response header and its trace: the caller's `x-request-id` when it is usable,
//! else a fresh UUID v4. (The batching loop's u64 ids are a separate, internal number.)

use axum::http::{HeaderMap, HeaderValue};

/// The request and response header.
pub const HEADER: &str = "x-request-id";
/// Longest caller-given id kept; a longer one is replaced (log lines stay bounded).
pub const MAX_LEN: usize = 128;

/// The caller's id when it is 1 to `MAX_LEN` visible ASCII characters (no spaces or
/// control characters, which would garble text logs); `None` otherwise.
pub fn from_caller(value: &HeaderValue) -> Option<&str> {
    let bytes = value.as_bytes();
    let usable = (1..=MAX_LEN).contains(&bytes.len()) && bytes.iter().all(u8::is_ascii_graphic);
    // All visible ASCII, so valid UTF-8.
    usable.then(|| std::str::from_utf8(bytes).ok()).flatten()
}

/// A new id: a UUID v4.
pub fn generate() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// The id of a request with these headers: the caller's when usable, else a new one.
pub fn of_request(headers: &HeaderMap) -> String {
    headers
        .get(HEADER)
        .and_then(from_caller)
        .map_or_else(generate, str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(value: &[u8]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(HEADER, HeaderValue::from_bytes(value).unwrap());
        headers
    }

    #[test]
    fn a_usable_caller_id_is_kept_as_it_is() {
        assert_eq!(of_request(&headers(b"req-42")), "req-42");
        let longest = "a".repeat(MAX_LEN);
        assert_eq!(of_request(&headers(longest.as_bytes())), longest);
        let symbols = "A~!#$%&'*+-.^_`|0:/=";
        assert_eq!(of_request(&headers(symbols.as_bytes())), symbols);
    }

    #[test]
    fn an_unusable_caller_id_is_replaced_by_a_uuid() {
        let too_long = "a".repeat(MAX_LEN + 1);
        for bad in [
            &b""[..],
            b"has space",
            b"tab\there",
            "é".as_bytes(),
            too_long.as_bytes(),
        ] {
            let id = of_request(&headers(bad));
            assert_ne!(id.as_bytes(), bad);
            assert!(uuid::Uuid::parse_str(&id).is_ok(), "{id}");
        }
    }

    #[test]
    fn without_a_caller_id_each_request_gets_a_distinct_uuid_v4() {
        let (a, b) = (of_request(&HeaderMap::new()), of_request(&HeaderMap::new()));
        assert_ne!(a, b);
        assert_eq!(uuid::Uuid::parse_str(&a).unwrap().get_version_num(), 4);
    }
}
