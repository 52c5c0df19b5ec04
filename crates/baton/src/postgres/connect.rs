//! How the PostgreSQL backend reaches its database: the URL, libpq's environment variables for
//! what the URL leaves out, and TLS as `sslmode` asks (rustls on ring).
//!
//! | sslmode | TLS | the server's certificate |
//! |---|---|---|
//! | `disable` | never | — |
//! | `prefer` (default) | if the server offers it | not checked (as libpq) |
//! | `require` | always | not checked, unless a root certificate is given or `~/.postgresql/root.crt` exists: then as `verify-ca` (as libpq) |
//! | `verify-ca` | always | signed by the root certificate |
//! | `verify-full` | always | signed by it, and names the host |
//!
//! The root certificate is `sslrootcert=FILE` (PEM), else `PGSSLROOTCERT`, else
//! `~/.postgresql/root.crt`. Environment variables read when the URL does not say: `PGHOST`,
//! `PGPORT`, `PGUSER` (else `USER`), `PGPASSWORD`, `PGDATABASE`, `PGAPPNAME` (else `baton`),
//! `PGCONNECT_TIMEOUT`, `PGSSLMODE`, `PGSSLROOTCERT`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres::config::{Host, SslMode as PgSslMode};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::error::{Error, Result};

/// libpq's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    fn parse(text: &str) -> Option<SslMode> {
        Some(match text {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            _ => return None,
        })
    }
}

/// How to open a connection: with or without TLS.
#[derive(Clone)]
pub(crate) enum Connector {
    Plain,
    Tls(MakeRustlsConnect),
}

/// The connection settings from `url` (baton's `schema` already taken out) and, where it is
/// silent, from the environment (`env`, normally `std::env::var`).
pub(crate) fn configure(
    url: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(tokio_postgres::Config, Connector)> {
    let invalid = |reason: String| Error::InvalidUrl {
        url: crate::url::redact(url),
        reason,
    };
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut sslmode = None;
    let mut root = None;
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("sslmode", value)) => sslmode = Some(value.to_string()),
            Some(("sslrootcert", value)) => root = Some(PathBuf::from(value)),
            Some(("sslcert" | "sslkey" | "sslpassword", _)) => {
                return Err(invalid(
                    "client certificates (sslcert, sslkey) are not supported; use a password"
                        .into(),
                ))
            }
            _ => kept.push(pair),
        }
    }
    let rest = if kept.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    let mut config: tokio_postgres::Config = rest
        .parse()
        .map_err(|error: tokio_postgres::Error| invalid(super::one_line(&error)))?;
    if config.get_hosts().is_empty() {
        let hosts = env("PGHOST").unwrap_or_else(|| "localhost".into());
        for host in hosts.split(',').filter(|h| !h.is_empty()) {
            if host.starts_with('/') {
                config.host_path(host);
            } else {
                config.host(host);
            }
        }
    }
    // tokio-postgres fills in 5432 for a host without a port: libpq takes PGPORT then.
    if !names_port(&rest) {
        if let Some(ports) = env("PGPORT") {
            let ports = ports
                .split(',')
                .map(|port| {
                    port.parse::<u16>()
                        .map_err(|_| invalid(format!("PGPORT={port:?} is not a port number")))
                })
                .collect::<Result<Vec<u16>>>()?;
            let hosts = config.get_hosts().to_vec();
            let mut fresh = config.clone();
            // Rebuild the host list with PGPORT's ports (one for all, or one per host).
            fresh = rebuild_ports(fresh, &hosts, &ports);
            config = fresh;
        }
    }
    if config.get_user().is_none() {
        match env("PGUSER").or_else(|| env("USER")) {
            Some(user) => config.user(&user),
            None => return Err(invalid("no user (give one in the URL or PGUSER)".into())),
        };
    }
    if config.get_password().is_none() {
        if let Some(password) = env("PGPASSWORD") {
            config.password(password);
        }
    }
    if config.get_dbname().is_none() {
        if let Some(db) = env("PGDATABASE") {
            config.dbname(&db);
        }
    }
    if config.get_application_name().is_none() {
        // Named, so that an operator can tell baton's connections apart (pg_stat_activity).
        config.application_name(env("PGAPPNAME").unwrap_or_else(|| "baton".into()));
    }
    if config.get_connect_timeout().is_none() {
        if let Some(seconds) = env("PGCONNECT_TIMEOUT") {
            let seconds: u64 = seconds.parse().map_err(|_| {
                invalid(format!(
                    "PGCONNECT_TIMEOUT={seconds:?} is not a number of seconds"
                ))
            })?;
            config.connect_timeout(Duration::from_secs(seconds.max(2)));
        }
    }
    let mode_text = sslmode
        .or_else(|| env("PGSSLMODE"))
        .unwrap_or_else(|| "prefer".into());
    let mode = SslMode::parse(&mode_text).ok_or_else(|| {
        invalid(format!(
            "sslmode={mode_text:?} (expected disable, prefer, require, verify-ca or verify-full)"
        ))
    })?;
    let explicit_root = root.or_else(|| env("PGSSLROOTCERT").map(PathBuf::from));
    let default_root = env("HOME").map(|home| Path::new(&home).join(".postgresql/root.crt"));
    let root = explicit_root
        .clone()
        .or_else(|| default_root.filter(|path| path.exists()));
    config.ssl_mode(match mode {
        SslMode::Disable => PgSslMode::Disable,
        SslMode::Prefer => PgSslMode::Prefer,
        _ => PgSslMode::Require,
    });
    let verify = match (mode, &root) {
        (SslMode::Disable, _) => return Ok((config, Connector::Plain)),
        (SslMode::Prefer, _) | (SslMode::Require, None) => Verify::Nothing,
        (SslMode::Require | SslMode::VerifyCa, Some(root)) => Verify::Chain(roots(root)?),
        (SslMode::VerifyFull, Some(root)) => Verify::ChainAndName(roots(root)?),
        (SslMode::VerifyCa | SslMode::VerifyFull, None) => {
            return Err(invalid(format!(
                "sslmode={mode_text} needs a root certificate: sslrootcert=FILE, PGSSLROOTCERT \
                 or ~/.postgresql/root.crt"
            )))
        }
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier: Arc<dyn ServerCertVerifier> = match verify {
        Verify::Nothing => Arc::new(AnyCertificate(provider.clone())),
        Verify::Chain(roots) | Verify::ChainAndName(roots) => {
            let webpki = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
                .build()
                .map_err(|error| invalid(format!("root certificate: {error}")))?;
            Arc::new(Checked {
                webpki,
                name: mode == SslMode::VerifyFull,
            })
        }
    };
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|error| invalid(format!("TLS: {error}")))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    Ok((config, Connector::Tls(MakeRustlsConnect::new(tls))))
}

/// Whether the URL names a port itself (`host:port` in its authority, or `port=`).
fn names_port(url: &str) -> bool {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    if query.split('&').any(|pair| pair.starts_with("port=")) {
        return true;
    }
    let authority = base
        .split_once("://")
        .map_or("", |(_, rest)| rest.split('/').next().unwrap_or(""));
    let hosts = authority
        .rsplit_once('@')
        .map_or(authority, |(_, hosts)| hosts);
    hosts.split(',').any(|host| {
        // `[v6]:port` or `name:port`; a bare `[v6]` has its colons inside the brackets.
        let after = host.rsplit_once(']').map_or(host, |(_, after)| after);
        after.contains(':')
    })
}

/// `config` with its hosts given `ports` (one for every host, or one per host).
fn rebuild_ports(
    config: tokio_postgres::Config,
    hosts: &[Host],
    ports: &[u16],
) -> tokio_postgres::Config {
    let mut fresh = tokio_postgres::Config::new();
    for (i, host) in hosts.iter().enumerate() {
        match host {
            Host::Tcp(name) => fresh.host(name),
            Host::Unix(path) => fresh.host_path(path),
        };
        fresh.port(*ports.get(i).or(ports.last()).unwrap_or(&5432));
    }
    if let Some(user) = config.get_user() {
        fresh.user(user);
    }
    if let Some(password) = config.get_password() {
        fresh.password(password);
    }
    if let Some(db) = config.get_dbname() {
        fresh.dbname(db);
    }
    if let Some(options) = config.get_options() {
        fresh.options(options);
    }
    if let Some(name) = config.get_application_name() {
        fresh.application_name(name);
    }
    if let Some(timeout) = config.get_connect_timeout() {
        fresh.connect_timeout(*timeout);
    }
    fresh.ssl_mode(config.get_ssl_mode());
    fresh.target_session_attrs(config.get_target_session_attrs());
    fresh.channel_binding(config.get_channel_binding());
    fresh
}

/// The label of `config`'s hosts, for messages (`host:port,...`).
pub(crate) fn label(config: &tokio_postgres::Config) -> String {
    config
        .get_hosts()
        .iter()
        .zip(config.get_ports().iter().chain(std::iter::repeat(&5432)))
        .map(|(host, port)| match host {
            Host::Tcp(host) => format!("{host}:{port}"),
            Host::Unix(path) => path.display().to_string(),
        })
        .collect::<Vec<_>>()
        .join(",")
}

enum Verify {
    Nothing,
    Chain(Arc<RootCertStore>),
    ChainAndName(Arc<RootCertStore>),
}

/// The root certificates in the PEM file at `path`.
fn roots(path: &Path) -> Result<Arc<RootCertStore>> {
    let bad = |reason: String| Error::InvalidUrl {
        url: format!("sslrootcert={}", path.display()),
        reason,
    };
    let mut store = RootCertStore::empty();
    let certificates = CertificateDer::pem_file_iter(path)
        .map_err(|error| bad(format!("cannot read it: {error}")))?;
    for certificate in certificates {
        let certificate = certificate.map_err(|error| bad(format!("not PEM: {error}")))?;
        store
            .add(certificate)
            .map_err(|error| bad(format!("not a usable certificate: {error}")))?;
    }
    if store.is_empty() {
        return Err(bad("holds no certificate".into()));
    }
    Ok(Arc::new(store))
}

/// `prefer` and `require` without a root certificate: the connection is encrypted, the
/// server's certificate is not checked (as libpq does); the handshake's signatures still are.
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `verify-ca` (the chain only) and `verify-full` (the chain and the host's name).
#[derive(Debug)]
struct Checked {
    webpki: Arc<WebPkiServerVerifier>,
    name: bool,
}

impl ServerCertVerifier for Checked {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        match self.webpki.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        ) {
            Err(rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName))
                if !self.name =>
            {
                Ok(ServerCertVerified::assertion())
            }
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForNameContext { .. },
            )) if !self.name => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |name| {
            pairs
                .iter()
                .find(|(key, _)| *key == name)
                .map(|(_, value)| value.to_string())
        }
    }

    #[test]
    fn the_environment_fills_in_what_the_url_leaves_out() {
        let env = env_of(&[
            ("PGHOST", "db.example,/run/pg"),
            ("PGPORT", "6543"),
            ("PGUSER", "alice"),
            ("PGPASSWORD", "secret"),
            ("PGDATABASE", "jobs"),
            ("PGSSLMODE", "disable"),
            ("USER", "root"),
        ]);
        let (config, connector) = configure("postgres://", &env).unwrap();
        assert_eq!(label(&config), "db.example:6543,/run/pg");
        assert_eq!(config.get_user(), Some("alice"));
        assert_eq!(config.get_password(), Some(&b"secret"[..]));
        assert_eq!(config.get_dbname(), Some("jobs"));
        assert_eq!(config.get_application_name(), Some("baton"));
        assert!(matches!(connector, Connector::Plain));
        // A host without a port takes PGPORT, as libpq does; a port in the URL wins.
        let (config, _) = configure("postgres://bob@h1,h2/db", &env).unwrap();
        assert_eq!(label(&config), "h1:6543,h2:6543");
        assert_eq!(config.get_user(), Some("bob"));
        let (config, _) = configure("postgres://bob@h1:7/db", &env).unwrap();
        assert_eq!(label(&config), "h1:7");
        let bad = |name: &str| (name == "PGPORT").then(|| "abc".to_string());
        let error = configure("postgres://bob@h/db", &bad)
            .err()
            .unwrap()
            .to_string();
        assert!(error.contains("PGPORT=\"abc\""), "{error}");
        // The URL wins over the environment.
        let (config, connector) =
            configure("postgres://bob:pw@h:1/db?sslmode=require", &env).unwrap();
        assert_eq!(label(&config), "h:1");
        assert_eq!(config.get_user(), Some("bob"));
        assert_eq!(config.get_password(), Some(&b"pw"[..]));
        assert_eq!(config.get_dbname(), Some("db"));
        assert_eq!(config.get_ssl_mode(), PgSslMode::Require);
        assert!(matches!(connector, Connector::Tls(_)));
    }

    #[test]
    fn bad_settings_are_one_clear_line() {
        let none = |_: &str| None;
        for (url, expected) in [
            ("postgres://u@h/db?sslmode=maybe", "sslmode=\"maybe\""),
            (
                "postgres://u@h/db?sslmode=verify-full",
                "needs a root certificate",
            ),
            (
                "postgres://u@h/db?sslmode=verify-ca&sslrootcert=/nonexistent/ca.pem",
                "cannot read it",
            ),
            ("postgres://u@h/db?sslcert=c.pem", "client certificates"),
            ("postgres://u@h/db?bogus=1", "bogus"),
            ("postgres://h/db", "no user"),
        ] {
            let error = match configure(url, &none) {
                Err(error) => error.to_string(),
                Ok(_) => panic!("{url} accepted"),
            };
            assert!(error.contains(expected), "{url}: {error}");
            assert!(!error.contains('\n'), "{error}");
        }
        let error = configure("postgres://u:hunter2@h/db?sslmode=x", &none)
            .err()
            .unwrap()
            .to_string();
        assert!(!error.contains("hunter2"), "{error}");
    }
}
