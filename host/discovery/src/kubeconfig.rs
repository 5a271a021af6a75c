//! A kubeconfig file (kubectl's `~/.kube/config`), as much of it as discovery needs: the
//! context in force (the file's `current-context`, or one named), its cluster's server
//! and CA, its user's bearer token or client certificate, and its namespace. Parsing is
//! pure (the fuzzer reads it); files a kubeconfig names are read by the caller, bounded.
//! Credentials that run a program (`exec`, `auth-provider`) are refused by name: the
//! router runs nothing a file names.

use std::path::{Path, PathBuf};

use base64::Engine as _;
use serde_json::Value;

/// The largest kubeconfig read.
pub const MAX_KUBECONFIG: usize = 1 << 20;

/// Bytes given in the file (`…-data`, base64) or a file it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// The bytes themselves.
    Data(Vec<u8>),
    /// A file, relative paths taken from the kubeconfig's directory.
    File(PathBuf),
}

/// What one context of a kubeconfig says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Context {
    /// The API server's URL.
    pub server: String,
    /// Its CA (PEM), if the file names one (else the system's roots).
    pub ca: Option<Source>,
    /// A bearer token.
    pub token: Option<Source>,
    /// A client certificate (PEM) and its key.
    pub identity: Option<(Source, Source)>,
    /// The context's namespace, if it names one.
    pub namespace: Option<String>,
}

/// The context `name` (else the file's `current-context`) of the kubeconfig `text`, with
/// relative paths taken from `dir`.
pub fn parse(text: &str, dir: &Path, name: Option<&str>) -> Result<Context, String> {
    if text.len() > MAX_KUBECONFIG {
        return Err(format!("over {MAX_KUBECONFIG} bytes"));
    }
    let v: Value = serde_norway::from_str(text).map_err(|e| format!("not YAML: {e}"))?;
    let name = match name {
        Some(n) => n,
        None => v["current-context"]
            .as_str()
            .filter(|n| !n.is_empty())
            .ok_or("no current-context, and no context named (--kube-context)")?,
    };
    let context = named(&v, "contexts", "context", name)?;
    let cluster_name = context["cluster"]
        .as_str()
        .ok_or_else(|| format!("context `{name}` names no cluster"))?;
    let cluster = named(&v, "clusters", "cluster", cluster_name)?;
    let server = cluster["server"]
        .as_str()
        .filter(|s| s.starts_with("https://") || s.starts_with("http://"))
        .ok_or_else(|| format!("cluster `{cluster_name}` has no http(s) server"))?
        .trim_end_matches('/')
        .to_string();
    if cluster["insecure-skip-tls-verify"] == true {
        return Err(format!(
            "cluster `{cluster_name}` skips TLS verification, which this router never does: give its CA"
        ));
    }
    let ca = source(cluster, "certificate-authority", dir)?;
    let user = match context["user"].as_str() {
        Some(u) => named(&v, "users", "user", u)?,
        None => &Value::Null,
    };
    for runs in ["exec", "auth-provider"] {
        if !user[runs].is_null() {
            return Err(format!(
                "the user of context `{name}` gets its credentials by `{runs}`, which this router does not run: give a token or a client certificate"
            ));
        }
    }
    let token = match (user["token"].as_str(), user["tokenFile"].as_str()) {
        (Some(t), _) => Some(Source::Data(t.as_bytes().to_vec())),
        (None, Some(f)) => Some(Source::File(dir.join(f))),
        (None, None) => None,
    };
    let identity = match (
        source(user, "client-certificate", dir)?,
        source(user, "client-key", dir)?,
    ) {
        (Some(c), Some(k)) => Some((c, k)),
        (None, None) => None,
        _ => {
            return Err(format!(
                "the user of context `{name}` has a client certificate or key without the other"
            ));
        }
    };
    let namespace = context["namespace"]
        .as_str()
        .filter(|n| !n.is_empty())
        .map(str::to_string);
    Ok(Context {
        server,
        ca,
        token,
        identity,
        namespace,
    })
}

/// The `inner` object of the entry of list `list` named `name`.
fn named<'a>(v: &'a Value, list: &str, inner: &str, name: &str) -> Result<&'a Value, String> {
    v[list]
        .as_array()
        .into_iter()
        .flatten()
        .find(|e| e["name"] == name)
        .map(|e| &e[inner])
        .filter(|e| e.is_object())
        .ok_or_else(|| format!("no {inner} `{name}` in {list}"))
}

/// `key-data` (base64) or `key` (a path) of `obj`.
fn source(obj: &Value, key: &str, dir: &Path) -> Result<Option<Source>, String> {
    if let Some(data) = obj[format!("{key}-data")].as_str() {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(data.trim())
            .map_err(|e| format!("{key}-data: not base64: {e}"))?;
        return Ok(Some(Source::Data(bytes)));
    }
    Ok(obj[key].as_str().map(|p| Source::File(dir.join(p))))
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"
apiVersion: v1
kind: Config
current-context: dev
clusters:
- name: local
  cluster:
    server: https://127.0.0.1:6443/
    certificate-authority: ca.crt
- name: other
  cluster:
    server: https://10.0.0.1
    certificate-authority-data: aGVsbG8=
contexts:
- name: dev
  context: {cluster: local, user: cert, namespace: llm}
- name: ops
  context: {cluster: other, user: bearer}
users:
- name: cert
  user: {client-certificate: c.crt, client-key-data: a2V5}
- name: bearer
  user: {token: abc}
"#;

    #[test]
    fn a_context_gives_its_server_ca_credentials_and_namespace() {
        let dir = Path::new("/home/me/.kube");
        let dev = parse(FILE, dir, None).unwrap();
        assert_eq!(dev.server, "https://127.0.0.1:6443");
        assert_eq!(dev.ca, Some(Source::File(dir.join("ca.crt"))));
        assert_eq!(
            dev.identity,
            Some((
                Source::File(dir.join("c.crt")),
                Source::Data(b"key".to_vec())
            ))
        );
        assert_eq!(dev.namespace.as_deref(), Some("llm"));
        let ops = parse(FILE, dir, Some("ops")).unwrap();
        assert_eq!(ops.ca, Some(Source::Data(b"hello".to_vec())));
        assert_eq!(ops.token, Some(Source::Data(b"abc".to_vec())));
        assert_eq!((ops.identity, ops.namespace), (None, None));
    }

    /// Aliases that expand a small file into billions of nodes are refused, not
    /// expanded.
    #[test]
    fn an_alias_bomb_is_refused() {
        let mut bomb = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
        for (prev, next) in ["a", "b", "c", "d", "e", "f", "g", "h"]
            .iter()
            .zip(["b", "c", "d", "e", "f", "g", "h", "i"])
        {
            let refs = vec![format!("*{prev}"); 10].join(", ");
            bomb.push_str(&format!("{next}: &{next} [{refs}]\n"));
        }
        bomb.push_str("current-context: i\n");
        let e = parse(&bomb, Path::new("."), None).unwrap_err();
        assert!(e.starts_with("not YAML"), "{e}");
    }

    #[test]
    fn what_it_cannot_use_is_named() {
        let dir = Path::new(".");
        for (text, name, says) in [
            (FILE, Some("nope"), "no context `nope`"),
            ("current-context: x\n", None, "no context `x`"),
            ("clusters: []\n", None, "no current-context"),
            (
                &FILE.replace("token: abc", "exec: {command: aws}"),
                Some("ops"),
                "`exec`",
            ),
            (
                &FILE.replace(
                    "    server: https://10.0.0.1\n",
                    "    server: https://10.0.0.1\n    insecure-skip-tls-verify: true\n",
                ),
                Some("ops"),
                "skips TLS",
            ),
            (
                &FILE.replace("client-key-data: a2V5", "username: x"),
                None,
                "without the other",
            ),
            (
                &FILE.replace("aGVsbG8=", "not*base64"),
                Some("ops"),
                "not base64",
            ),
            ("{{{{", None, "not YAML"),
        ] {
            let e = parse(text, dir, name).unwrap_err();
            assert!(e.contains(says), "{says}: {e}");
        }
    }
}
