//! Backend URLs: `etcd://host:port[,host:port]/prefix`, `zk://host:port[,host:port]/chroot`,
//! `postgres://user[:password]@host:port/db?schema=NAME` (also `postgresql://`),
//! `memory://NAME`.

use crate::error::{Error, Result};

/// Default key prefix when the URL has no path.
const DEFAULT_PREFIX: &str = "/baton";

/// The segment between an election's name and its candidates' entries
/// (`<prefix>/<election>/@candidates/<entry>`). It may be neither an election name nor a segment
/// of the prefix, which is what keeps two elections' keys apart (see the etcd backend's
/// `candidates_scope`).
pub(crate) const CANDIDATES_MARKER: &str = "@candidates";

/// The segment under an election that holds one entry per live candidate id
/// (`<prefix>/<election>/@ids/<id>`, bound to the candidate's lease), so that two live
/// candidates with the same id are detected.
pub(crate) const IDS_MARKER: &str = "@ids";

/// Whether `segment` is one baton reserves inside an election's keys: neither an election name
/// nor a segment of a prefix may be one, so no two elections share a key.
pub(crate) fn is_reserved(segment: &str) -> bool {
    segment == CANDIDATES_MARKER || segment == IDS_MARKER
}

/// A parsed backend URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendUrl {
    /// An etcd v3 cluster (or `baton server`).
    Etcd {
        /// `host:port` endpoints.
        endpoints: Vec<String>,
        /// Key prefix, starting with `/` and without a trailing one.
        prefix: String,
    },
    /// A ZooKeeper ensemble (`zk://` or `zookeeper://`).
    ZooKeeper {
        /// `host:port` endpoints.
        endpoints: Vec<String>,
        /// The znode everything of baton's lives under, starting with `/` and without a
        /// trailing one (created by the first campaign if missing; reads create nothing).
        chroot: String,
    },
    /// A PostgreSQL database (`postgres://` or `postgresql://`, libpq's URL form).
    Postgres {
        /// The URL without baton's own `schema` parameter (passwords stay in it: never print
        /// it as it is; baton's own errors show it with the password masked).
        url: String,
        /// The schema baton's tables live in (`schema=NAME`, default `baton`).
        schema: String,
    },
    /// The in-memory store of this process called `name` (see [`crate::MemoryStore`]).
    Memory {
        /// The store's name.
        name: String,
    },
}

impl BackendUrl {
    /// Parses a URL, naming the problem in the error.
    pub fn parse(url: &str) -> Result<BackendUrl> {
        let invalid = |reason: &str| Error::InvalidUrl {
            url: url.to_string(),
            reason: reason.to_string(),
        };
        let Some((scheme, rest)) = url.split_once("://") else {
            return Err(invalid(
                "expected scheme://host:port/prefix, for example etcd://127.0.0.1:2379/baton",
            ));
        };
        let zookeeper = match scheme {
            "etcd" => false,
            "zk" | "zookeeper" => true,
            "memory" => {
                let name = rest.trim_end_matches('/');
                if name.is_empty() || name.contains('/') || name.chars().any(char::is_control) {
                    return Err(invalid(
                        "expected memory://NAME, a name without '/' or control characters",
                    ));
                }
                return Ok(BackendUrl::Memory {
                    name: name.to_string(),
                });
            }
            "postgres" | "postgresql" => return parse_postgres(url),
            _ => {
                return Err(invalid(&format!(
                    "unknown scheme {scheme:?} (supported: etcd, zk, postgres, memory)"
                )))
            }
        };
        if rest.contains(['?', '#']) {
            return Err(invalid("query strings and fragments are not supported"));
        }
        let (hosts, path) = match rest.find('/') {
            Some(at) => rest.split_at(at),
            None => (rest, ""),
        };
        if hosts.is_empty() {
            return Err(invalid("no host given"));
        }
        let mut endpoints = Vec::new();
        for host in hosts.split(',') {
            let Some((name, port)) = host.rsplit_once(':') else {
                return Err(invalid(&format!("endpoint {host:?} has no port")));
            };
            if name.is_empty() {
                return Err(invalid(&format!("endpoint {host:?} has no host name")));
            }
            if name.contains('@') {
                return Err(invalid(&format!(
                    "endpoint {host:?}: user names and passwords are not supported in the URL"
                )));
            }
            // An IPv6 address is bracketed; any other colon is one too many.
            let bracketed = name.starts_with('[') && name.ends_with(']');
            if name.contains(':') && !bracketed {
                return Err(invalid(&format!(
                    "endpoint {host:?} has an invalid host name"
                )));
            }
            if port.parse::<u16>().ok().filter(|&p| p != 0).is_none() {
                return Err(invalid(&format!("endpoint {host:?} has an invalid port")));
            }
            endpoints.push(host.to_string());
        }
        let trimmed = path.trim_end_matches('/');
        let prefix = if trimmed.is_empty() {
            DEFAULT_PREFIX.to_string()
        } else {
            trimmed.to_string()
        };
        let what = if zookeeper { "chroot" } else { "prefix" };
        if prefix.contains("//") || prefix.chars().any(char::is_control) {
            return Err(invalid(&format!(
                "{what} has empty segments or control characters"
            )));
        }
        if let Some(segment) = prefix.split('/').find(|segment| is_reserved(segment)) {
            return Err(invalid(&format!(
                "{what} must not contain the segment {segment:?} (reserved for the candidates \
                 of an election)"
            )));
        }
        if zookeeper {
            if let Some(problem) = zookeeper_path_problem(&prefix) {
                return Err(invalid(&format!("chroot {prefix:?} {problem}")));
            }
            if prefix == "/zookeeper" || prefix.starts_with("/zookeeper/") {
                return Err(invalid(
                    "chroot must not be inside /zookeeper (ZooKeeper's own)",
                ));
            }
            return Ok(BackendUrl::ZooKeeper {
                endpoints,
                chroot: prefix,
            });
        }
        Ok(BackendUrl::Etcd { endpoints, prefix })
    }
}

/// Whether ZooKeeper refuses `c` in a path (its PathUtils: control characters, the private use
/// area, and the last code points of the basic plane). It checks UTF-16 units, so it also
/// refuses every character outside the basic plane (an emoji, say): a surrogate pair.
pub(crate) fn zookeeper_refuses(c: char) -> bool {
    matches!(c, '\u{0}'..='\u{1f}' | '\u{7f}'..='\u{9f}' | '\u{e000}'..='\u{f8ff}' | '\u{fff0}'..)
}

/// Why ZooKeeper would refuse the absolute `path` (`None` if it would not): an empty segment,
/// a segment `.` or `..`, or a character ZooKeeper does not allow in a path.
pub(crate) fn zookeeper_path_problem(path: &str) -> Option<&'static str> {
    let segments = path.strip_prefix('/')?.split('/');
    for segment in segments {
        if segment.is_empty() {
            return Some("has an empty segment");
        }
        if segment == "." || segment == ".." {
            return Some("has a segment \".\" or \"..\"");
        }
        if segment.chars().any(zookeeper_refuses) {
            return Some("has a character ZooKeeper does not allow in a path");
        }
    }
    None
}

/// A PostgreSQL URL: libpq's form, plus baton's `schema=NAME` (an identifier: lower-case
/// letters, digits and `_`, at most 40 characters, not starting with a digit).
fn parse_postgres(url: &str) -> Result<BackendUrl> {
    let invalid = |reason: &str| Error::InvalidUrl {
        url: redact(url),
        reason: reason.to_string(),
    };
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut schema = "baton".to_string();
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("schema", value)) => schema = value.to_string(),
            _ => kept.push(pair),
        }
    }
    check_schema(&schema).map_err(|reason| invalid(&reason))?;
    let url = if kept.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok(BackendUrl::Postgres { url, schema })
}

/// A PostgreSQL schema name baton accepts: lower-case letters, digits and `_`, at most 40
/// characters, not starting with a digit (so it never needs quoting in SQL).
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
pub(crate) fn check_schema(schema: &str) -> std::result::Result<(), String> {
    let identifier = !schema.is_empty()
        && schema.len() <= 40
        && schema
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && !schema.starts_with(|c: char| c.is_ascii_digit());
    if identifier {
        Ok(())
    } else {
        Err(
            "schema must be lower-case letters, digits and '_' (at most 40, not starting with a \
             digit)"
                .into(),
        )
    }
}

/// `url` with any password replaced by `***`, for messages.
pub(crate) fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((user_info, hosts)) => match user_info.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***@{hosts}{tail}"),
            None => url.to_string(),
        },
        None => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_endpoints_and_prefix() {
        assert_eq!(
            BackendUrl::parse("etcd://127.0.0.1:2379,10.0.0.2:2379/jobs/").unwrap(),
            BackendUrl::Etcd {
                endpoints: vec!["127.0.0.1:2379".into(), "10.0.0.2:2379".into()],
                prefix: "/jobs".into()
            }
        );
        assert_eq!(
            BackendUrl::parse("etcd://localhost:2379").unwrap(),
            BackendUrl::Etcd {
                endpoints: vec!["localhost:2379".into()],
                prefix: "/baton".into()
            }
        );
    }

    #[test]
    fn parses_ipv6_endpoints() {
        assert_eq!(
            BackendUrl::parse("etcd://[::1]:2379/x").unwrap(),
            BackendUrl::Etcd {
                endpoints: vec!["[::1]:2379".into()],
                prefix: "/x".into()
            }
        );
    }

    #[test]
    fn parses_zookeeper_urls() {
        for url in [
            "zk://127.0.0.1:2181,h2:2182/jobs/",
            "zookeeper://127.0.0.1:2181,h2:2182/jobs",
        ] {
            assert_eq!(
                BackendUrl::parse(url).unwrap(),
                BackendUrl::ZooKeeper {
                    endpoints: vec!["127.0.0.1:2181".into(), "h2:2182".into()],
                    chroot: "/jobs".into()
                }
            );
        }
        assert_eq!(
            BackendUrl::parse("zk://[::1]:2181").unwrap(),
            BackendUrl::ZooKeeper {
                endpoints: vec!["[::1]:2181".into()],
                chroot: "/baton".into()
            }
        );
    }

    #[test]
    fn parses_memory_names() {
        assert_eq!(
            BackendUrl::parse("memory://tests-1").unwrap(),
            BackendUrl::Memory {
                name: "tests-1".into()
            }
        );
    }

    #[test]
    fn the_marker_is_only_reserved_as_a_whole_segment() {
        assert!(BackendUrl::parse("etcd://h:1/a/@candidatesx").is_ok());
        assert!(BackendUrl::parse("etcd://h:1/a/x@candidates").is_ok());
    }

    #[test]
    fn rejects_bad_urls_with_a_reason() {
        for (url, needle) in [
            ("http://x:1", "unknown scheme"),
            ("127.0.0.1:2379", "expected scheme"),
            ("etcd://", "no host"),
            ("etcd://host/prefix", "no port"),
            ("etcd://host:99999", "invalid port"),
            ("etcd://:2379", "no host name"),
            ("postgres://u@h/db?schema=Bad-Name", "schema must be"),
            ("zk://h:1/a//b", "empty segments"),
            ("zk://h:1/a/../b", "\"..\""),
            ("zk://h:1/zookeeper/x", "inside /zookeeper"),
            ("zookeeper://h:1/@ids", "reserved"),
            ("zk://h:1/a\u{e000}", "does not allow"),
            ("etcd://h:1/a//b", "empty segments"),
            ("etcd://h:1/@candidates", "reserved"),
            ("etcd://h:1/a/@candidates/b/", "reserved"),
            ("memory://", "expected memory://NAME"),
            ("etcd://127.0.0.1:2379:5/x", "invalid host name"),
            ("etcd://user@h:1/x", "user names"),
            ("etcd://h:1/x?y", "query strings"),
            ("memory://a/b", "expected memory://NAME"),
        ] {
            let message = BackendUrl::parse(url).unwrap_err().to_string();
            assert!(message.contains(needle), "{url}: {message}");
        }
    }
}
