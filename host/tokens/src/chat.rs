//! Chat messages to one prompt: the model's own chat template, or ChatML.
//!
//! A router that renders a chat differently from the engine hashes other blocks than the
//! engine caches, and sees no overlap at all. So the router renders with the template the
//! engine uses: the `chat_template` of the model's `tokenizer_config.json` (or its
//! `chat_template.jinja`), a Jinja template, rendered here with `minijinja` and Python's
//! string methods (`strip`, `startswith`, `items`, … as Hugging Face templates use them).
//! Without a template, messages are rendered ChatML style (see [`ChatFormat::ChatMl`]).

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::ChatMessage;

/// How chat messages become one prompt.
pub enum ChatFormat {
    /// `<|im_start|>{role}\n{content}<|im_end|>\n` per message, then
    /// `<|im_start|>assistant\n` (the generation prompt).
    ChatMl,
    /// A model's Jinja chat template.
    Template(Box<ChatTemplate>),
}

impl std::fmt::Debug for ChatFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChatFormat::ChatMl => f.write_str("ChatMl"),
            ChatFormat::Template(t) => write!(f, "Template({})", t.source.display()),
        }
    }
}

/// A compiled chat template and the special tokens it refers to.
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    bos_token: String,
    eos_token: String,
    source: PathBuf,
}

/// A chat template that cannot load, or a chat it refuses.
#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    /// The file cannot be read or holds no usable template.
    #[error("chat template {path}: {why}")]
    Load {
        /// The file.
        path: PathBuf,
        /// Why.
        why: String,
    },
    /// The template refused the messages (`raise_exception`, say roles that do not
    /// alternate) or failed on them: the request's fault.
    #[error("the model's chat template rejected the messages: {0}")]
    Render(String),
}

const TEMPLATE: &str = "chat";

impl ChatFormat {
    /// The template in `path`: a `tokenizer_config.json` (its `chat_template`, the
    /// `default` one of a list, and its `bos_token`/`eos_token`), or a Jinja file.
    pub fn from_file(path: &Path) -> Result<ChatFormat, ChatTemplateError> {
        let load = |why: String| ChatTemplateError::Load {
            path: path.to_path_buf(),
            why,
        };
        let text = super::read_text(path, super::MAX_TEMPLATE_FILE).map_err(load)?;
        if path.extension().is_some_and(|e| e == "json") {
            let config: Value =
                serde_json::from_str(&text).map_err(|e| load(format!("not JSON: {e}")))?;
            return ChatFormat::from_config(&config, path);
        }
        ChatTemplate::new(text, String::new(), String::new(), path.to_path_buf())
            .map(|t| ChatFormat::Template(Box::new(t)))
            .map_err(load)
    }

    /// The template of a `tokenizer_config.json` read from `path`, already parsed.
    fn from_config(config: &Value, path: &Path) -> Result<ChatFormat, ChatTemplateError> {
        let load = |why: String| ChatTemplateError::Load {
            path: path.to_path_buf(),
            why,
        };
        let template = template_of(config).ok_or_else(|| {
            load("has no `chat_template` (a string, or a list with a `default`)".into())
        })?;
        let (bos, eos) = (token_of(config, "bos_token"), token_of(config, "eos_token"));
        ChatTemplate::new(template, bos, eos, path.to_path_buf())
            .map(|t| ChatFormat::Template(Box::new(t)))
            .map_err(load)
    }

    /// The template that comes with the `tokenizer.json` at `tokenizer` in a Hugging Face
    /// model directory: `chat_template.jinja` beside it (newer models; its special tokens
    /// from `tokenizer_config.json`), else `tokenizer_config.json`'s `chat_template`.
    /// `None` when the directory has neither.
    pub fn beside_tokenizer(tokenizer: &Path) -> Result<Option<ChatFormat>, ChatTemplateError> {
        let dir = tokenizer.parent().unwrap_or(Path::new("."));
        let config_path = dir.join("tokenizer_config.json");
        let config: Option<Value> = super::read_text(&config_path, super::MAX_TEMPLATE_FILE)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok());
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            let source = super::read_text(&jinja, super::MAX_TEMPLATE_FILE).map_err(|why| {
                ChatTemplateError::Load {
                    path: jinja.clone(),
                    why,
                }
            })?;
            let token = |k| config.as_ref().map(|c| token_of(c, k)).unwrap_or_default();
            return ChatTemplate::new(
                source,
                token("bos_token"),
                token("eos_token"),
                jinja.clone(),
            )
            .map(|t| Some(ChatFormat::Template(Box::new(t))))
            .map_err(|why| ChatTemplateError::Load { path: jinja, why });
        }
        match config {
            Some(c) if template_of(&c).is_some() => {
                ChatFormat::from_config(&c, &config_path).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// The chat format a model's files give: the template at `explicit` if given, else the
    /// one beside `tokenizer` (see [`ChatFormat::beside_tokenizer`]), else ChatML.
    pub fn resolve(
        explicit: Option<&Path>,
        tokenizer: Option<&Path>,
    ) -> Result<ChatFormat, ChatTemplateError> {
        let found = match (explicit, tokenizer) {
            (Some(path), _) => Some(ChatFormat::from_file(path)?),
            (None, Some(tokenizer)) => ChatFormat::beside_tokenizer(tokenizer)?,
            (None, None) => None,
        };
        if let Some(path) = found.as_ref().and_then(ChatFormat::source) {
            tracing::info!(path = %path.display(), "chats rendered with the model's chat template");
        }
        Ok(found.unwrap_or(ChatFormat::ChatMl))
    }

    /// The prompt for `messages`, with the generation prompt (the assistant's turn) at
    /// the end. A conversation's earlier turns render to a prefix of its later ones with
    /// ChatML and with the usual templates, so multi-turn chats reuse their KV cache.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, ChatTemplateError> {
        match self {
            ChatFormat::ChatMl => Ok(render_chatml(messages)),
            ChatFormat::Template(t) => t.render(messages),
        }
    }

    /// The prompt for `messages` whose last (assistant) message is left open to be
    /// continued: no end-of-turn after it and no generation prompt (vLLM's and SGLang's
    /// `continue_final_message`). With a template: rendered without the generation
    /// prompt and cut after the last message's text, as Hugging Face's
    /// `apply_chat_template` does, its trailing whitespace kept.
    pub fn render_continuation(
        &self,
        messages: &[ChatMessage],
    ) -> Result<String, ChatTemplateError> {
        let Some((last, earlier)) = messages.split_last() else {
            return self.render(messages);
        };
        match self {
            ChatFormat::ChatMl => {
                let mut s = render_chatml_turns(earlier);
                s.push_str("<|im_start|>");
                s.push_str(&last.role);
                s.push('\n');
                s.push_str(&last.content);
                Ok(s)
            }
            ChatFormat::Template(t) => {
                let rendered = t.render_with(messages, false)?;
                // Templates may trim a message; its trailing whitespace is given back.
                let text = last.content.trim();
                let Some(at) = rendered.rfind(text) else {
                    return Err(ChatTemplateError::Render(
                        "the template drops the final message's text, so it cannot be continued"
                            .into(),
                    ));
                };
                let trailing = &last.content[last.content.trim_end().len()..];
                Ok(format!("{}{trailing}", &rendered[..at + text.len()]))
            }
        }
    }

    /// Where the template came from (`None`: ChatML).
    pub fn source(&self) -> Option<&Path> {
        match self {
            ChatFormat::ChatMl => None,
            ChatFormat::Template(t) => Some(&t.source),
        }
    }
}

fn render_chatml(messages: &[ChatMessage]) -> String {
    let mut s = render_chatml_turns(messages);
    s.push_str("<|im_start|>assistant\n");
    s
}

fn render_chatml_turns(messages: &[ChatMessage]) -> String {
    let mut s = String::new();
    for m in messages {
        s.push_str("<|im_start|>");
        s.push_str(&m.role);
        s.push('\n');
        s.push_str(&m.content);
        s.push_str("<|im_end|>\n");
    }
    s
}

/// `chat_template` as a string, or the `default` entry of a list of named templates.
fn template_of(config: &Value) -> Option<String> {
    match config.get("chat_template")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(named) => named
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_string),
        _ => None,
    }
}

/// A special token, given as a string or as an added-token object (`{"content": ..}`).
fn token_of(config: &Value, key: &str) -> String {
    match config.get(key) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

impl ChatTemplate {
    fn new(
        source: String,
        bos_token: String,
        eos_token: String,
        path: PathBuf,
    ) -> Result<ChatTemplate, String> {
        let mut env = minijinja::Environment::new();
        // As Hugging Face renders them: blocks trimmed, Python's
        // string and dict methods, and `raise_exception` to refuse a conversation.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<(), minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template_owned(TEMPLATE, source)
            .map_err(|e| format!("not a valid template: {e:#}"))?;
        Ok(ChatTemplate {
            env,
            bos_token,
            eos_token,
            source: path,
        })
    }

    fn render(&self, messages: &[ChatMessage]) -> Result<String, ChatTemplateError> {
        self.render_with(messages, true)
    }

    fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
            .collect();
        let template = self
            .env
            .get_template(TEMPLATE)
            .map_err(|e| ChatTemplateError::Render(e.to_string()))?;
        template
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            })
            .map_err(|e| ChatTemplateError::Render(render_error(&e)))
    }
}

/// The template's own words for a `raise_exception`, else minijinja's description.
fn render_error(e: &minijinja::Error) -> String {
    match e.detail() {
        Some(detail) if e.kind() == minijinja::ErrorKind::InvalidOperation => detail.to_string(),
        _ => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    /// Llama 3's template, as its `tokenizer_config.json` holds it (abridged: no tools).
    const LLAMA3: &str = "{{- bos_token }}\n{%- for message in messages %}\n{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}\n{%- endfor %}\n{%- if add_generation_prompt %}\n{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n{%- endif %}\n";

    /// Mistral's: roles must alternate, said with `raise_exception`.
    const MISTRAL: &str = "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'].strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'].strip() + eos_token }}{% endif %}{% endfor %}";

    fn config_file(dir: &Path, config: Value) -> PathBuf {
        let path = dir.join("tokenizer_config.json");
        std::fs::write(&path, config.to_string()).unwrap();
        path
    }

    #[test]
    fn a_continued_chat_is_the_original_prompt_followed_by_the_partial_answer() {
        let dir = tempfile::tempdir().unwrap();
        let path = config_file(
            dir.path(),
            serde_json::json!({"chat_template": LLAMA3, "bos_token": "<|begin_of_text|>"}),
        );
        let llama = ChatFormat::from_file(&path).unwrap();
        for chat in [ChatFormat::ChatMl, llama] {
            let asked = [m("system", "Be brief."), m("user", "Tell a story")];
            let partial = "Once upon a time ";
            let mut continued = asked.to_vec();
            continued.push(m("assistant", partial));
            let original = chat.render(&asked).unwrap();
            assert_eq!(
                chat.render_continuation(&continued).unwrap(),
                format!("{original}{partial}"),
                "{chat:?}"
            );
        }
    }

    #[test]
    fn a_template_that_drops_the_final_message_cannot_continue_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = config_file(
            dir.path(),
            serde_json::json!({"chat_template": "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}"}),
        );
        let chat = ChatFormat::from_file(&path).unwrap();
        let e = chat
            .render_continuation(&[m("user", "Hi"), m("assistant", "Hello the")])
            .unwrap_err();
        assert!(e.to_string().contains("cannot be continued"), "{e}");
    }

    #[test]
    fn a_tokenizer_config_template_renders_as_the_engine_would() {
        let dir = tempfile::tempdir().unwrap();
        let path = config_file(
            dir.path(),
            serde_json::json!({"chat_template": LLAMA3, "bos_token": "<|begin_of_text|>",
                "eos_token": {"content": "<|eot_id|>", "lstrip": false}}),
        );
        let chat = ChatFormat::from_file(&path).unwrap();
        let prompt = chat
            .render(&[m("system", "Be brief. "), m("user", "Hi")])
            .unwrap();
        assert_eq!(
            prompt,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
             <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
        // An earlier turn's prompt, less its generation prompt, is a prefix of the next.
        let turn1 = chat.render(&[m("user", "Hi")]).unwrap();
        let turn2 = chat
            .render(&[m("user", "Hi"), m("assistant", "Hello!"), m("user", "More")])
            .unwrap();
        let head = turn1.trim_end_matches("<|start_header_id|>assistant<|end_header_id|>\n\n");
        assert!(turn2.starts_with(head), "{turn2}");
    }

    #[test]
    fn python_string_methods_and_raise_exception_work() {
        let dir = tempfile::tempdir().unwrap();
        let path = config_file(
            dir.path(),
            serde_json::json!({"chat_template": [{"name": "tool_use", "template": "x"},
                {"name": "default", "template": MISTRAL}], "bos_token": "<s>", "eos_token": "</s>"}),
        );
        let chat = ChatFormat::from_file(&path).unwrap();
        assert_eq!(
            chat.render(&[m("user", "  Hi "), m("assistant", "Yo"), m("user", "Go")])
                .unwrap(),
            "<s>[INST] Hi [/INST]Yo</s>[INST] Go [/INST]"
        );
        let err = chat.render(&[m("user", "a"), m("user", "b")]).unwrap_err();
        assert!(
            matches!(&err, ChatTemplateError::Render(why) if why.contains("roles must alternate")),
            "{err}"
        );
    }

    #[test]
    fn bad_template_files_are_refused_with_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let no_template = config_file(dir.path(), serde_json::json!({"bos_token": "<s>"}));
        let err = ChatFormat::from_file(&no_template).unwrap_err();
        assert!(err.to_string().contains("no `chat_template`"), "{err}");
        let broken = dir.path().join("broken.jinja");
        std::fs::write(&broken, "{% for m in messages %}{{ m.content }}").unwrap();
        let err = ChatFormat::from_file(&broken).unwrap_err();
        assert!(err.to_string().contains("not a valid template"), "{err}");
        assert!(ChatFormat::from_file(&dir.path().join("missing.json")).is_err());
    }

    #[test]
    fn the_template_beside_a_tokenizer_is_found() {
        let dir = tempfile::tempdir().unwrap();
        let tokenizer = dir.path().join("tokenizer.json");
        assert!(ChatFormat::beside_tokenizer(&tokenizer).unwrap().is_none());
        config_file(
            dir.path(),
            serde_json::json!({"chat_template": LLAMA3, "bos_token": "<B>"}),
        );
        let chat = ChatFormat::beside_tokenizer(&tokenizer).unwrap().unwrap();
        assert!(
            chat.render(&[m("user", "x")])
                .unwrap()
                .starts_with("<B><|start_header_id|>user")
        );
        // A `chat_template.jinja` wins, with the config's special tokens.
        std::fs::write(dir.path().join("chat_template.jinja"), "{{ bos_token }}J").unwrap();
        let chat = ChatFormat::beside_tokenizer(&tokenizer).unwrap().unwrap();
        assert_eq!(chat.render(&[m("user", "x")]).unwrap(), "<B>J");
    }
}
