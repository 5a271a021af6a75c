//! Secrets: the admin token and etcd's credentials, from files (private to this user) or
//! variables, never from the command line or the config file.

use std::path::PathBuf;

use super::ConfigError;
use switchyard_discovery::etcd::EtcdConfig;

/// How every command that talks to etcd reaches it: its own user authentication and TLS.
/// The password is never a flag (it would show in the process list): it comes from a
/// file or from `SWITCHYARD_ETCD_PASSWORD`.
#[derive(Debug, Default, Clone, clap::Args)]
pub struct EtcdAccessArgs {
    /// etcd user, when etcd has authentication enabled; the password is read from
    /// --etcd-password-file or the SWITCHYARD_ETCD_PASSWORD variable.
    #[arg(long, env = "SWITCHYARD_ETCD_USER")]
    pub etcd_user: Option<String>,
    /// File holding the etcd user's password (its first line).
    #[arg(long, env = "SWITCHYARD_ETCD_PASSWORD_FILE")]
    pub etcd_password_file: Option<PathBuf>,
    /// PEM CA certificate(s) trusted for an https:// etcd besides the system roots
    /// (repeatable).
    #[arg(
        long = "etcd-ca-file",
        env = "SWITCHYARD_ETCD_CA_FILES",
        value_delimiter = ','
    )]
    pub etcd_ca_files: Vec<PathBuf>,
}

impl EtcdAccessArgs {
    /// `config` with this TLS trust and these credentials.
    pub fn apply(&self, config: EtcdConfig) -> Result<EtcdConfig, ConfigError> {
        let tls = switchyard_net::upstream::Tls::with_ca_files(&self.etcd_ca_files)
            .map_err(|e| ConfigError(format!("etcd: {e}")))?;
        let password = match (
            &self.etcd_password_file,
            std::env::var("SWITCHYARD_ETCD_PASSWORD"),
        ) {
            // Its first line, from a file private to this user (as the admin token's).
            (Some(path), _) => Some(
                read_secret_file(path, "the etcd password file")?
                    .lines()
                    .next()
                    .unwrap_or("")
                    .to_string(),
            ),
            (None, Ok(p)) => Some(p),
            (None, Err(_)) => None,
        };
        let auth = match (&self.etcd_user, password) {
            (Some(user), Some(password)) => Some(switchyard_discovery::etcd_api::EtcdAuth {
                user: user.clone(),
                password,
            }),
            (Some(user), None) => {
                return Err(ConfigError(format!(
                    "etcd user `{user}` has no password: give --etcd-password-file or set \
                     SWITCHYARD_ETCD_PASSWORD"
                )));
            }
            (None, Some(_)) => {
                return Err(ConfigError(
                    "an etcd password was given without --etcd-user".into(),
                ));
            }
            (None, None) => None,
        };
        Ok(EtcdConfig {
            tls,
            auth,
            ..config
        })
    }
}

/// The shortest admin token accepted, in bytes: a guessable token is no token.
pub const MIN_ADMIN_TOKEN_BYTES: usize = 16;

/// The admin token: from the environment or a file (this user's, mode 0600 or stricter),
/// at least [`MIN_ADMIN_TOKEN_BYTES`]; never from the command line or the config file
/// (which others may read).
pub(super) fn admin_token(
    on_command_line: Option<String>,
    in_config_file: Option<String>,
    from_env: Option<String>,
    file: Option<PathBuf>,
) -> Result<Option<String>, ConfigError> {
    if on_command_line.is_some() {
        return Err(ConfigError(
            "--admin-token puts the token where every user of the machine can read it (the \
             process list): give it in a file (--admin-token-file, mode 0600) or in \
             SWITCHYARD_ADMIN_TOKEN"
                .into(),
        ));
    }
    if in_config_file.is_some() {
        return Err(ConfigError(
            "admin_token in the config file: name a file holding it (admin_token_file, mode \
             0600) instead"
                .into(),
        ));
    }
    let token = match (from_env, file) {
        (Some(_), Some(_)) => {
            return Err(ConfigError(
                "give the admin token in SWITCHYARD_ADMIN_TOKEN or in a file, not both".into(),
            ));
        }
        (Some(t), None) => t,
        (None, Some(path)) => read_secret_file(&path, "admin token file")?,
        (None, None) => return Ok(None),
    };
    if token.len() < MIN_ADMIN_TOKEN_BYTES {
        return Err(ConfigError(format!(
            "the admin token has {} bytes; at least {MIN_ADMIN_TOKEN_BYTES} (e.g. `openssl rand -hex 32`)",
            token.len()
        )));
    }
    Ok(Some(token))
}

/// A secret from a file that must be this user's and readable by no one else; its text,
/// trimmed, not empty; a file over 4 KiB is refused (not cut: a cut secret fails later,
/// far from its cause).
/// The largest secret file read.
const SECRET_FILE_LIMIT: u64 = 4096;

pub(super) fn read_secret_file(path: &std::path::Path, what: &str) -> Result<String, ConfigError> {
    use std::io::Read;
    let fail = |why: String| ConfigError(format!("{what} {}: {why}", path.display()));
    let file = std::fs::File::open(path).map_err(|e| fail(e.to_string()))?;
    let meta = file.metadata().map_err(|e| fail(e.to_string()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if meta.mode() & 0o077 != 0 {
            return Err(fail(format!(
                "mode {:o} lets others read it; chmod 600 it",
                meta.mode() & 0o777
            )));
        }
    }
    let _ = meta;
    let mut text = String::new();
    file.take(SECRET_FILE_LIMIT + 1)
        .read_to_string(&mut text)
        .map_err(|e| fail(e.to_string()))?;
    if text.len() as u64 > SECRET_FILE_LIMIT {
        return Err(fail(format!(
            "it is over {SECRET_FILE_LIMIT} bytes, more than a secret takes"
        )));
    }
    let text = text.trim().to_string();
    if text.is_empty() {
        return Err(fail("it is empty".into()));
    }
    Ok(text)
}
