//! HTTPS: the listening socket wrapped in TLS (rustls, with `ring` as its cryptography)
//! when `--ssl-certfile` and `--ssl-keyfile` are given.
//!
//! Handshakes run in their own tasks, so a client that opens a connection and never
//! finishes its handshake holds neither the accept loop nor anyone else's connection.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use crate::error::RouterError;

/// A handshake not finished in this time is dropped (the client's connection closes).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections whose handshake is done but that the HTTP server has not taken yet.
const READY_BACKLOG: usize = 128;

/// The files of `--ssl-certfile` and `--ssl-keyfile`.
#[derive(Debug, Clone)]
pub struct TlsFiles<'a> {
    pub certfile: &'a Path,
    pub keyfile: &'a Path,
}

/// rustls' server configuration from PEM files: the certificate chain (leaf first) and
/// its private key (PKCS#8, PKCS#1 or SEC1). Each error names the file and what is wrong.
pub fn server_config(files: &TlsFiles<'_>) -> Result<Arc<ServerConfig>, RouterError> {
    let chain = read_certificates(files.certfile, "--ssl-certfile")?;
    let key = PrivateKeyDer::from_pem_file(files.keyfile).map_err(|e| {
        RouterError::Args(format!(
            "--ssl-keyfile {}: no PEM private key could be read: {e}",
            files.keyfile.display()
        ))
    })?;
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| RouterError::Args(format!("TLS: {e}")))?;
    let mut config = builder
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| {
            RouterError::Args(format!(
                "--ssl-certfile {} and --ssl-keyfile {} do not make a usable pair: {e}",
                files.certfile.display(),
                files.keyfile.display()
            ))
        })?;
    // The HTTP server speaks HTTP/1.1 only; saying so lets clients skip an h2 attempt.
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

fn read_certificates(path: &Path, flag: &str) -> Result<Vec<CertificateDer<'static>>, RouterError> {
    let unreadable =
        |e: &dyn std::fmt::Display| RouterError::Args(format!("{flag} {}: {e}", path.display()));
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| unreadable(&e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| unreadable(&e))?;
    if certs.is_empty() {
        return Err(unreadable(&"holds no PEM certificate"));
    }
    Ok(certs)
}

/// A listener whose connections have finished their TLS handshake: a task accepts TCP
/// connections and hands each to a handshake task; finished ones queue here.
pub struct TlsListener {
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
    accepting: JoinHandle<()>,
}

impl TlsListener {
    pub fn new(tcp: TcpListener, config: Arc<ServerConfig>) -> std::io::Result<Self> {
        let local = tcp.local_addr()?;
        let (send, ready) = mpsc::channel(READY_BACKLOG);
        let acceptor = TlsAcceptor::from(config);
        let accepting = tokio::spawn(accept_loop(tcp, acceptor, send));
        Ok(Self {
            ready,
            local,
            accepting,
        })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        // The socket is the accept task's: closing it is stopping the task.
        self.accepting.abort();
    }
}

async fn accept_loop(
    tcp: TcpListener,
    acceptor: TlsAcceptor,
    ready: mpsc::Sender<(TlsStream<TcpStream>, SocketAddr)>,
) {
    loop {
        let (stream, peer) = match tcp.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors and the like: wait instead of spinning.
                tracing::warn!(error = %e, "accepting a connection failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let acceptor = acceptor.clone();
        let ready = ready.clone();
        tokio::spawn(async move {
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => {
                    let _ = ready.send((tls, peer)).await;
                }
                Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
            }
        });
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(connection) => connection,
            // The accept task only ends when aborted, which is when `self` is dropped.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config_error(cert: &str, key: &str) -> String {
        let dir = std::env::temp_dir().join(format!("cadence-tls-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let (certfile, keyfile) = (dir.join("cert.pem"), dir.join("key.pem"));
        std::fs::write(&certfile, cert).unwrap();
        std::fs::write(&keyfile, key).unwrap();
        let files = TlsFiles {
            certfile: &certfile,
            keyfile: &keyfile,
        };
        let error = server_config(&files).unwrap_err().to_string();
        std::fs::remove_dir_all(&dir).unwrap();
        error
    }

    #[test]
    fn a_file_without_a_certificate_is_named() {
        let error = config_error("not a certificate\n", "");
        assert!(error.contains("--ssl-certfile"), "{error}");
        assert!(error.contains("holds no PEM certificate"), "{error}");
    }

    #[test]
    fn a_missing_key_is_named() {
        // A syntactically valid PEM block: the certificate is read before the key.
        let cert = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        let error = config_error(cert, "no key here\n");
        assert!(error.contains("--ssl-keyfile"), "{error}");
    }
}
