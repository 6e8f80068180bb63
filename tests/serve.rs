//! mlb-serve end to end: the real binary on an ephemeral port, used over real HTTP
//! (ureq), on the bundled default model (converted here as scripts/demo.sh does; given
//! a ChatML-style template with `mlt-convert --chat-template` for the chat routes).

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::util::fixtures::{convert, copy_files};
use crate::util::tool::tool;
use crate::util::{bin_path, testdata};

/// The template the tests give the default model; its end of turn is the EOS.
const TEMPLATE: &str = "{% for m in messages %}<|startoftext|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}{% if add_generation_prompt %}<|startoftext|>assistant\n{% endif %}";

/// The converted default model, its tokenizer without a chat section, and one with the
/// template (made once per test run).
struct Files {
    mlb: PathBuf,
    plain: PathBuf,
    chat: PathBuf,
}

fn files() -> &'static Files {
    static F: OnceLock<Files> = OnceLock::new();
    F.get_or_init(|| {
        let dir =
            Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("serve-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = testdata().join("default");
        let f = Files {
            mlb: dir.join("default.mlb"),
            plain: dir.join("plain.mlt"),
            chat: dir.join("default.mlt"),
        };
        let template = dir.join("template.jinja");
        std::fs::write(&template, TEMPLATE).unwrap();
        convert(&src, &f.mlb, &["--wtype", "q8_0"]);
        let json = src.join("tokenizer.json");
        tool("mlt-convert")
            .arg(&json)
            .arg("-o")
            .arg(&f.plain)
            .args(["-q", "--no-chat"])
            .ok();
        tool("mlt-convert")
            .arg(&json)
            .arg("-o")
            .arg(&f.chat)
            .arg("--chat-template")
            .arg(&template)
            .arg("-q")
            .ok();
        f
    })
}

/// A running mlb-serve; killed when dropped (if still running).
struct Server {
    child: Child,
    url: String,
    log: Arc<Mutex<String>>,
}

/// Starts mlb-serve on the default model (the chat tokenizer beside it) with `args`;
/// `Err((exit code, stderr))` if it exits before listening.
fn try_start(args: &[&str]) -> Result<Server, (Option<i32>, String)> {
    try_start_with(args, None)
}

/// [`try_start`] with `setup` run in the child before exec (resource limits).
fn try_start_with(
    args: &[&str],
    setup: Option<fn() -> std::io::Result<()>>,
) -> Result<Server, (Option<i32>, String)> {
    try_start_model(&files().mlb, args, setup)
}

/// [`try_start_with`] on another model file.
fn try_start_model(
    model: &Path,
    args: &[&str],
    setup: Option<fn() -> std::io::Result<()>>,
) -> Result<Server, (Option<i32>, String)> {
    let mut cmd = tool("mlb-serve");
    cmd.arg(model)
        .args(["--port", "0", "--threads", "2"])
        .args(args);
    #[cfg(unix)]
    if let Some(f) = setup {
        use std::os::unix::process::CommandExt;
        // SAFETY: `f` only makes system calls (setrlimit), safe after fork.
        unsafe { cmd.command().pre_exec(f) };
    }
    let mut child = cmd.spawn();
    let log = Arc::new(Mutex::new(String::new()));
    let (l2, mut err) = (log.clone(), child.stderr.take().unwrap());
    let errs = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = err.read(&mut buf) {
            if n == 0 {
                break;
            }
            l2.lock()
                .unwrap()
                .push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
    let (tx, rx) = mpsc::channel();
    let out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(out).lines();
        let _ = tx.send(lines.next().and_then(Result::ok));
        for _ in lines {}
    });
    match rx.recv_timeout(Duration::from_secs(120)) {
        Ok(Some(line)) => {
            let url = line
                .strip_prefix("listening on ")
                .unwrap_or_else(|| panic!("first line: {line}"))
                .to_string();
            assert!(url.starts_with("http://127.0.0.1:"), "{url}");
            Ok(Server { child, url, log })
        }
        _ => {
            let status = child.wait().unwrap();
            errs.join().unwrap();
            let e = log.lock().unwrap().clone();
            Err((status.code(), e))
        }
    }
}

fn start(args: &[&str]) -> Server {
    try_start(args).unwrap_or_else(|(c, e)| panic!("mlb-serve exited {c:?}: {e}"))
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into()
}

/// A response: status, headers we look at, body.
struct Reply {
    status: u16,
    retry_after: Option<String>,
    www_auth: Option<String>,
    body: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    /// An OpenAI error object with this status; returns it.
    fn error(&self, status: u16) -> Value {
        assert_eq!(self.status, status, "{}", self.body);
        let v = self.json();
        let e = &v["error"];
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        assert!(e["type"].is_string(), "{v}");
        assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
        e.clone()
    }
}

fn reply(r: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> Reply {
    let mut r = r.unwrap();
    let h = |k: &str| r.headers().get(k).map(|v| v.to_str().unwrap().to_string());
    let (retry_after, www_auth) = (h("retry-after"), h("www-authenticate"));
    Reply {
        status: r.status().as_u16(),
        retry_after,
        www_auth,
        body: r.body_mut().read_to_string().unwrap(),
    }
}

impl Server {
    fn get(&self, path: &str) -> Reply {
        reply(agent().get(format!("{}{path}", self.url)).call())
    }

    fn post(&self, path: &str, body: &str) -> Reply {
        self.post_with(path, body, None)
    }

    fn post_with(&self, path: &str, body: &str, key: Option<&str>) -> Reply {
        let mut r = agent()
            .post(format!("{}{path}", self.url))
            .header("content-type", "application/json");
        if let Some(k) = key {
            r = r.header("authorization", format!("Bearer {k}"));
        }
        reply(r.send(body))
    }

    /// POSTs a request with `"stream": true`; returns the `data:` payloads up to and
    /// including `[DONE]`.
    fn stream(&self, path: &str, body: &Value) -> Vec<String> {
        let mut body = body.clone();
        body["stream"] = json!(true);
        let r = agent()
            .post(format!("{}{path}", self.url))
            .send(body.to_string())
            .unwrap();
        assert_eq!(r.status(), 200);
        let ct = r.headers().get("content-type").unwrap().to_str().unwrap();
        assert!(ct.starts_with("text/event-stream"), "{ct}");
        let mut out = Vec::new();
        for line in BufReader::new(r.into_body().into_reader()).lines() {
            let line = line.unwrap();
            if let Some(d) = line.strip_prefix("data: ") {
                out.push(d.to_string());
            } else {
                assert!(line.is_empty(), "not SSE: {line}");
            }
        }
        assert_eq!(out.last().map(String::as_str), Some("[DONE]"), "{out:?}");
        out
    }

    /// POSTs the streaming completion `body`; returns its first line (a `data:` line)
    /// and the lines after it, unread.
    fn stream_started(&self, body: &Value) -> (String, std::io::Lines<impl BufRead>) {
        let r = agent()
            .post(format!("{}/v1/completions", self.url))
            .send(body.to_string())
            .unwrap();
        let mut lines = BufReader::new(r.into_body().into_reader()).lines();
        let first = lines.next().unwrap().unwrap();
        assert!(first.starts_with("data: "), "{first}");
        (first, lines)
    }

    /// [`Server::stream_started`] on a streaming completion that runs to `max_tokens`
    /// (no EOS).
    fn long_stream_started(&self, max_tokens: u32) -> (String, std::io::Lines<impl BufRead>) {
        let body = json!({"prompt": "A", "max_tokens": max_tokens, "temperature": 0, "stream": true, "logit_bias": {"2": -100}});
        self.stream_started(&body)
    }

    /// A short completion answers 200.
    fn assert_serves(&self) {
        let r = self.post(
            "/v1/completions",
            &json!({"prompt": "A", "max_tokens": 2}).to_string(),
        );
        assert_eq!(r.status, 200, "{}", r.body);
    }

    /// Waits (30 s at most) for the server to exit; asserts it exited 0 after logging
    /// that it was shutting down.
    fn assert_shut_down(&mut self) {
        let t0 = Instant::now();
        let status = loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                break st;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "no exit: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(status.code(), Some(0), "{}", self.log());
        assert!(self.log().contains("shutting down"), "{}", self.log());
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Sends `sig` to the server.
    #[cfg(unix)]
    fn signal(&self, sig: libc::c_int) {
        // SAFETY: kill(2) on our own running child.
        assert_eq!(unsafe { libc::kill(self.pid(), sig) }, 0);
    }

    /// Sends SIGTERM and asserts a clean exit within `limit` (`after`: what the log line
    /// says the exit came after).
    fn sigterm_exits_within(&mut self, limit: Duration, after: &str) {
        let t0 = Instant::now();
        self.signal(libc::SIGTERM);
        self.assert_shut_down();
        let took = t0.elapsed();
        eprintln!("exit {took:?} after {after}");
        assert!(took < limit, "{took:?}");
    }

    /// The server's resident memory (VmRSS), KiB.
    fn rss_kib(&self) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let l = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
        l.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    /// Waits until /health reports no busy slot and no queued request.
    fn wait_idle(&self) {
        let t0 = Instant::now();
        loop {
            let h = self.get("/health").json();
            if h["slots_processing"] == 0 && h["requests_queued"] == 0 {
                return;
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "never idle: {h}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The text of a stream's chunks (chat deltas or completion texts), its finish reason
/// and its usage chunk.
fn stream_text(data: &[String]) -> (String, String, Option<Value>) {
    let mut text = String::new();
    let mut finish = String::new();
    let mut usage = None;
    for d in &data[..data.len() - 1] {
        let v: Value = serde_json::from_str(d).unwrap();
        assert!(v.get("error").is_none(), "{v}");
        if v["choices"].as_array().unwrap().is_empty() {
            usage = Some(v["usage"].clone());
            continue;
        }
        let c = &v["choices"][0];
        if let Some(t) = c["delta"]["content"].as_str().or(c["text"].as_str()) {
            text.push_str(t);
        }
        if let Some(f) = c["finish_reason"].as_str() {
            finish = f.to_string();
        }
    }
    (text, finish, usage)
}

/// mlb-run's greedy continuation of `prompt` (the reference for the server's).
fn mlb_run_greedy(prompt: &str, n: usize) -> String {
    mlb_run_greedy_with(prompt, n, &[])
}

fn mlb_run_greedy_with(prompt: &str, n: usize, args: &[&str]) -> String {
    let f = files();
    let out = tool("mlb-run")
        .arg(&f.mlb)
        .args(["--prompt", prompt, "-n", &n.to_string(), "--temp", "0"])
        .args(args)
        .ok();
    let s = String::from_utf8(out.stdout_bytes).unwrap();
    s.strip_suffix('\n').unwrap_or(&s).to_string()
}

#[test]
fn serve_kv_types_answer_as_mlb_run() {
    for kv in ["f16", "q8_0"] {
        let s = start(&["--parallel", "2", "--kv-type", kv]);
        let prompt = "A function is";
        let want = mlb_run_greedy_with(prompt, 12, &["--kv-type", kv]);
        let body = json!({"prompt": prompt, "max_tokens": 12, "temperature": 0});
        let r = s.post("/v1/completions", &body.to_string());
        assert_eq!(r.status, 200, "{kv}: {}", r.body);
        assert_eq!(r.json()["choices"][0]["text"], want.as_str(), "{kv}");
    }
}

#[test]
fn serve_completions() {
    let s = start(&["--parallel", "2"]);
    let h = s.get("/health");
    assert_eq!(h.status, 200);
    assert_eq!(h.json()["status"], "ok");
    let m = s.get("/v1/models").json();
    assert_eq!(m["object"], "list");
    assert_eq!(m["data"][0]["id"], "default");
    assert_eq!(m["data"][0]["object"], "model");

    let prompt = "A function is";
    let want = mlb_run_greedy(prompt, 12);
    let body = json!({"model": "default", "prompt": prompt, "max_tokens": 12, "temperature": 0});
    let r = s.post("/v1/completions", &body.to_string());
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["model"], "default");
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
    let c = &v["choices"][0];
    assert_eq!(c["index"], 0);
    assert_eq!(c["text"], want.as_str());
    assert_eq!(c["logprobs"], Value::Null);
    let n_prompt = s
        .post(
            "/tokenize",
            &json!({"content": prompt, "add_special": true}).to_string(),
        )
        .json()["tokens"]
        .as_array()
        .unwrap()
        .len();
    let u = &v["usage"];
    assert_eq!(u["prompt_tokens"], n_prompt);
    let done = u["completion_tokens"].as_u64().unwrap();
    assert_eq!(u["total_tokens"], n_prompt as u64 + done);
    assert_eq!(
        c["finish_reason"],
        if done == 12 { "length" } else { "stop" },
        "{v}"
    );
    // The same prompt again: all but its last id come from the slot.
    let again = s.post("/v1/completions", &body.to_string()).json();
    assert_eq!(again["choices"][0]["text"], want.as_str());
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"],
        n_prompt - 1
    );

    // Streaming, with the usage chunk.
    let mut sb = body.clone();
    sb["stream_options"] = json!({"include_usage": true});
    let data = s.stream("/v1/completions", &sb);
    let (text, finish, usage) = stream_text(&data);
    assert_eq!(text, want);
    assert_eq!(finish, c["finish_reason"].as_str().unwrap());
    let usage = usage.expect("a usage chunk");
    assert_eq!(usage["completion_tokens"], done);
    for d in &data[..data.len() - 2] {
        let v: Value = serde_json::from_str(d).unwrap();
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["usage"], Value::Null, "{v}");
    }
    // Without include_usage there is no usage at all.
    let data = s.stream("/v1/completions", &body);
    assert_eq!(stream_text(&data).0, want);
    assert!(data.iter().all(|d| !d.contains("\"usage\"")));

    // A stop string: the text ends before it.
    let cut = want.char_indices().nth(want.chars().count() / 2).unwrap().0;
    let stop = want[cut..].chars().take(2).collect::<String>();
    let at = want.find(&stop).unwrap();
    let v = s
        .post(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": [stop]})
                .to_string(),
        )
        .json();
    assert_eq!(v["choices"][0]["text"], &want[..at]);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    // Logprobs: the greedy choice is the most likely alternative.
    let v = s
        .post(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 3, "logit_bias": {"2": -100}}).to_string(),
        )
        .json();
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 4, "{v}");
    assert_eq!(lp["text_offset"][0], 0);
    for (i, top) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
        let top = top.as_object().unwrap();
        assert!(!top.is_empty() && top.len() <= 3);
        let best = top
            .values()
            .map(|x| x.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!(
            (lp["token_logprobs"][i].as_f64().unwrap() - best).abs() < 1e-6,
            "{v}"
        );
    }
    // Prompts as ids give the same text.
    let ids = s
        .post(
            "/tokenize",
            &json!({"content": prompt, "add_special": true}).to_string(),
        )
        .json()["tokens"]
        .clone();
    let v = s
        .post(
            "/v1/completions",
            &json!({"prompt": ids, "max_tokens": 12, "temperature": 0}).to_string(),
        )
        .json();
    assert_eq!(v["choices"][0]["text"], want.as_str());
}

#[test]
fn serve_chat() {
    let s = start(&[]);
    let conv = json!([{"role": "system", "content": "You answer."}, {"role": "user", "content": "What is a list?"}]);
    let body = json!({"model": "x", "messages": conv, "max_tokens": 10, "temperature": 0, "logit_bias": {"2": -100}});
    let r = s.post("/v1/chat/completions", &body.to_string());
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let c = &v["choices"][0];
    assert_eq!(c["message"]["role"], "assistant");
    assert_eq!(c["finish_reason"], "length");
    let reply = c["message"]["content"].as_str().unwrap().to_string();
    assert_eq!(v["usage"]["completion_tokens"], 10);

    // The prompt is the template's rendering, encoded without BOS.
    let rendered = "<|startoftext|>system\nYou answer.<|endoftext|>\n<|startoftext|>user\nWhat is a list?<|endoftext|>\n<|startoftext|>assistant\n";
    let ids = s
        .post("/tokenize", &json!({"content": rendered}).to_string())
        .json()["tokens"]
        .clone();
    assert_eq!(v["usage"]["prompt_tokens"], ids.as_array().unwrap().len());
    let want = s
        .post(
            "/v1/completions",
            &json!({"prompt": ids, "max_tokens": 10, "temperature": 0, "logit_bias": {"2": -100}})
                .to_string(),
        )
        .json();
    assert_eq!(want["choices"][0]["text"], reply.as_str());

    // Streaming: a role chunk first, then content, then the finish reason alone.
    let data = s.stream("/v1/chat/completions", &body);
    let first: Value = serde_json::from_str(&data[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let last: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["delta"], json!({}));
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(stream_text(&data).0, reply);

    // Multi-turn: the next turn's prompt starts with this one's prompt and reply, which
    // the slot still holds.
    let mut turn2 = conv.as_array().unwrap().clone();
    turn2.push(json!({"role": "assistant", "content": reply}));
    turn2.push(json!({"role": "user", "content": "And a tuple?"}));
    let v2 = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": turn2, "max_tokens": 4, "temperature": 0}).to_string(),
        )
        .json();
    let cached = v2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= ids.as_array().unwrap().len() as u64, "{v2}");

    // Logprobs in chat's shape.
    let v = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": conv, "max_tokens": 3, "temperature": 0, "logprobs": true, "top_logprobs": 2, "logit_bias": {"2": -100}}).to_string(),
        )
        .json();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 3, "{v}");
    for t in content {
        assert!(t["token"].is_string() && t["bytes"].is_array());
        let top = t["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        assert_eq!(t["logprob"], top[0]["logprob"], "{t}");
    }
    // Template kwargs reach the template (this one ignores them).
    let r = s.post(
        "/v1/chat/completions",
        &json!({"messages": conv, "max_tokens": 1, "chat_template_kwargs": {"enable_thinking": false}}).to_string(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn serve_tokenize_and_detokenize() {
    let s = start(&[]);
    let text = "A function is <|endoftext|> é";
    let v = s
        .post("/tokenize", &json!({"content": text}).to_string())
        .json();
    let ids: Vec<u64> = v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    assert!(ids.contains(&2), "special tokens are matched: {ids:?}");
    let with = s
        .post(
            "/tokenize",
            &json!({"content": text, "add_special": true}).to_string(),
        )
        .json();
    assert_eq!(with["tokens"][0], 1, "BOS first");
    let back = s
        .post("/detokenize", &json!({"tokens": ids}).to_string())
        .json();
    assert_eq!(back["content"], text);
    let p = s
        .post(
            "/tokenize",
            &json!({"content": "ab", "with_pieces": true}).to_string(),
        )
        .json();
    let joined: String = p["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["piece"].as_str().unwrap())
        .collect();
    assert_eq!(joined, "ab");
    s.post("/detokenize", &json!({"tokens": [99999]}).to_string())
        .error(400);
    s.post("/tokenize", &json!({"text": "x"}).to_string())
        .error(400);
}

#[test]
fn serve_bad_input_is_a_4xx_and_the_server_stays_up() {
    let s = start(&["--max-body", "4096"]);
    let p = |body: &str| s.post("/v1/completions", body);
    let e = p("{not json").error(400);
    assert!(
        e["message"].as_str().unwrap().contains("parse the JSON"),
        "{e}"
    );
    assert_eq!(p("[1, 2]").error(400)["param"], Value::Null);
    let e = p(r#"{"prompt": "a", "max_tokens": "many"}"#).error(400);
    assert_eq!(
        (e["param"].as_str(), e["code"].as_str()),
        (Some("max_tokens"), Some("invalid_type"))
    );
    for bad in [0, -3] {
        let e = p(&json!({"prompt": "a", "max_tokens": bad}).to_string()).error(400);
        assert_eq!(e["param"], "max_tokens");
    }
    // The default model's context is 256 positions.
    let e = p(&json!({"prompt": "a", "max_tokens": 1000}).to_string()).error(400);
    assert_eq!(e["code"], "context_length_exceeded");
    let long = "word ".repeat(400);
    let e = p(&json!({"prompt": long}).to_string()).error(400);
    assert_eq!(
        (e["code"].as_str(), e["param"].as_str()),
        (Some("context_length_exceeded"), Some("prompt"))
    );
    let e = p(&json!({"prompt": vec![5; 300]}).to_string()).error(400);
    assert_eq!(e["code"], "context_length_exceeded");
    assert_eq!(
        p(&json!({"prompt": [5, 2048]}).to_string()).error(400)["param"],
        "prompt"
    );
    assert_eq!(
        p(&json!({"prompt": "a", "temperature": -1}).to_string()).error(400)["param"],
        "temperature"
    );
    assert_eq!(
        p(&json!({"prompt": "a", "n": 3}).to_string()).error(400)["param"],
        "n"
    );
    assert_eq!(
        p(r#"{"max_tokens": 3}"#).error(400)["code"],
        "missing_required_parameter"
    );
    let c = |body: &str| s.post("/v1/chat/completions", body);
    assert_eq!(
        c(r#"{"messages": [{"role": "user", "content": "x"}], "stop": 5}"#).error(400)["param"],
        "stop"
    );
    assert_eq!(
        c(r#"{"messages": [{"content": "hi"}]}"#).error(400)["param"],
        "messages[0].role"
    );
    assert_eq!(c(r#"{"messages": 7}"#).error(400)["param"], "messages");
    // Over the body limit.
    let big = json!({"prompt": "x".repeat(8000)}).to_string();
    let e = p(&big).error(413);
    assert_eq!(e["code"], "request_too_large");
    // Unknown routes and methods.
    let e = s.get("/v1/nothing").error(404);
    assert!(e["message"].as_str().unwrap().contains("GET /v1/nothing"));
    s.get("/v1/completions").error(405);
    // Still up, still right.
    assert_eq!(s.get("/health").status, 200);
    let v = p(&json!({"prompt": "A function is", "max_tokens": 3, "temperature": 0}).to_string());
    assert_eq!(v.status, 200);
}

#[test]
fn serve_chat_without_a_template_is_an_error() {
    let s = start(&["--tokenizer", files().plain.to_str().unwrap()]);
    let e = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hi"}]}).to_string(),
        )
        .error(404);
    assert!(
        e["message"].as_str().unwrap().contains("no chat template"),
        "{e}"
    );
    // Completions work.
    let r = s.post(
        "/v1/completions",
        &json!({"prompt": "A", "max_tokens": 2}).to_string(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn serve_api_key() {
    let s = start(&["--api-key", "s3cret"]);
    let body = json!({"prompt": "A", "max_tokens": 2}).to_string();
    let r = s.post("/v1/completions", &body);
    let e = r.error(401);
    assert_eq!(r.www_auth.as_deref(), Some("Bearer"));
    assert!(e["message"]
        .as_str()
        .unwrap()
        .contains("didn't provide an API key"));
    for wrong in ["s3cre", "s3cret!", "S3CRET", ""] {
        let e = s
            .post_with("/v1/completions", &body, Some(wrong))
            .error(401);
        assert_eq!(e["code"], "invalid_api_key", "{wrong:?}");
    }
    assert_eq!(
        s.post_with("/v1/completions", &body, Some("s3cret")).status,
        200
    );
    assert_eq!(s.get("/v1/models").status, 401);
    assert_eq!(s.get("/health").status, 200, "health needs no key");
}

#[test]
fn serve_full_queue_is_503_with_retry_after() {
    let s = start(&["--parallel", "1", "--queue", "1"]);
    // Each request runs to the end of the context (no EOS).
    let body =
        json!({"prompt": "A", "max_tokens": 250, "temperature": 0, "logit_bias": {"2": -100}})
            .to_string();
    let n = 12;
    let gate = Arc::new(std::sync::Barrier::new(n));
    let replies: Vec<Reply> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..n)
            .map(|_| {
                let (gate, body, s) = (gate.clone(), &body, &s);
                sc.spawn(move || {
                    gate.wait();
                    s.post("/v1/completions", body)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let ok = replies.iter().filter(|r| r.status == 200).count();
    let busy: Vec<&Reply> = replies.iter().filter(|r| r.status == 503).collect();
    assert_eq!(ok + busy.len(), n, "only 200 or 503");
    assert!(
        ok >= 1 && !busy.is_empty(),
        "{ok} answered, {} refused",
        busy.len()
    );
    for r in busy {
        r.error(503);
        assert_eq!(r.retry_after.as_deref(), Some("1"));
    }
    s.wait_idle();
}

/// A client that goes away mid-stream frees its slot at the next step: the next
/// request is served at once, and the log shows the first cancelled.
#[test]
fn serve_disconnect_frees_the_slot() {
    let s = start(&["--parallel", "1"]);
    let (_, lines) = s.long_stream_started(250);
    drop(lines);
    s.wait_idle();
    let t0 = Instant::now();
    while !s.log().contains("cancelled (client gone)") {
        assert!(t0.elapsed() < Duration::from_secs(10), "{}", s.log());
        std::thread::sleep(Duration::from_millis(5));
    }
    let line = s
        .log()
        .lines()
        .find(|l| l.contains("cancelled"))
        .unwrap()
        .to_string();
    let generated: usize = line
        .split(", ")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(generated < 250, "{line}");
    s.assert_serves();
}

/// SIGTERM: running streams finish, new connections are refused, exit 0.
#[cfg(unix)]
#[test]
fn serve_graceful_shutdown() {
    let mut s = start(&["--parallel", "2"]);
    let (first, lines) = s.long_stream_started(200);
    s.signal(libc::SIGTERM);
    let mut data: Vec<String> = vec![first[6..].to_string()];
    for l in lines {
        if let Some(d) = l.unwrap().strip_prefix("data: ") {
            data.push(d.to_string());
        }
    }
    assert_eq!(data.last().unwrap(), "[DONE]");
    let (_, finish, _) = stream_text(&data);
    assert_eq!(finish, "length", "the running stream finished: {data:?}");
    s.assert_shut_down();
    assert!(std::net::TcpStream::connect(s.url.trim_start_matches("http://")).is_err());
}

#[test]
fn serve_startup_errors_are_one_line() {
    let f = files();
    for (args, want) in [
        (vec!["--parallel", "0"], "--parallel = 0"),
        (vec!["--ctx", "100000"], "--ctx = 100000"),
        (
            vec!["--tokenizer", "/nonexistent/t.mlt"],
            "/nonexistent/t.mlt",
        ),
        (vec!["--host", "256.1.1.1"], "cannot listen on 256.1.1.1:0"),
    ] {
        let (code, err) = match try_start(&args) {
            Ok(_) => panic!("{args:?} started"),
            Err(e) => e,
        };
        assert_eq!(code, Some(1), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(
            err.starts_with("mlb-serve: ") && err.contains(want),
            "{args:?}: {err}"
        );
    }
    // No tokenizer beside the model.
    let dir = tempfile::tempdir().unwrap();
    let lone = dir.path().join("lone.mlb");
    std::fs::copy(&f.mlb, &lone).unwrap();
    let err = tool("mlb-serve")
        .arg(&lone)
        .args(["--port", "0"])
        .fails_with(1);
    assert!(
        err.contains("no tokenizer") && err.contains("lone.mlt"),
        "{err}"
    );
    // The summary names the memory per slot.
    let s = start(&["--parallel", "3", "--ctx", "128"]);
    let t0 = Instant::now();
    while !s.log().contains("memory per slot") {
        assert!(t0.elapsed() < Duration::from_secs(10), "{}", s.log());
        std::thread::sleep(Duration::from_millis(5));
    }
    // 4 layers × 2 (k, v) × 128 positions × 64 (kv_dim) × 4 bytes = 256 KiB per slot.
    assert!(
        s.log().contains(
            "3 slots of 128 positions; memory per slot: KV cache 0.2 MiB (0.8 MiB for all slots)"
        ),
        "{}",
        s.log()
    );
}

/// Prompts read in chunks of 8 ids between other slots' steps give the same greedy
/// text as read whole.
#[test]
fn serve_chunked_prefill_gives_the_same_text() {
    let prompt =
        "The Python interpreter reads a program and runs it; a function is a block of code that "
            .repeat(2);
    let body = json!({"prompt": prompt, "max_tokens": 16, "temperature": 0}).to_string();
    let whole = start(&[]).post("/v1/completions", &body).json()["choices"][0]["text"].clone();
    let s = start(&["--parallel", "3", "--prefill-chunk", "8"]);
    let texts: Vec<Value> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..3)
            .map(|_| {
                sc.spawn(|| s.post("/v1/completions", &body).json()["choices"][0]["text"].clone())
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for t in texts {
        assert_eq!(t, whole);
    }
}

/// 16 concurrent streaming clients × 10 requests on 4 slots: every request completes,
/// greedy answers equal the same requests run alone, no errors, and the server's memory
/// does not grow.
#[test]
fn serve_load_16_clients_x_10_requests() {
    let s = start(&["--parallel", "4", "--queue", "16"]);
    let words = [
        "A function",
        "The list",
        "A class is",
        "Python",
        "An exception",
        "The module",
        "A string",
        "Numbers",
    ];
    let body = |i: usize| json!({"prompt": words[i % words.len()], "max_tokens": 8 + i % 5, "temperature": 0});
    // Alone, one at a time.
    let solo: Vec<String> = (0..words.len() * 5)
        .map(|i| {
            s.post("/v1/completions", &body(i).to_string()).json()["choices"][0]["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let run = |clients: usize, per: usize| {
        std::thread::scope(|sc| {
            let hs: Vec<_> = (0..clients)
                .map(|c| {
                    let (s, solo) = (&s, &solo);
                    sc.spawn(move || {
                        for k in 0..per {
                            let i = (c * 7 + k) % solo.len();
                            let data = s.stream("/v1/completions", &body(i));
                            let (text, finish, _) = stream_text(&data);
                            assert!(finish == "stop" || finish == "length");
                            assert_eq!(text, solo[i], "client {c} request {k}");
                        }
                    })
                })
                .collect();
            for h in hs {
                h.join().unwrap();
            }
        })
    };
    run(16, 2); // warm-up: every slot and buffer used
    s.wait_idle();
    let before = s.rss_kib();
    run(16, 10);
    s.wait_idle();
    let after = s.rss_kib();
    assert!(
        after <= before + 8 * 1024,
        "RSS grew from {before} KiB to {after} KiB"
    );
    assert!(
        !s.log().contains("cancelled") && !s.log().contains("failed"),
        "{}",
        s.log()
    );
    // A slot is free (and /health idle) before its log line reaches our reader thread.
    let want = solo.len() + 16 * 12;
    let t0 = Instant::now();
    let done = loop {
        let n = s
            .log()
            .lines()
            .filter(|l| l.contains("completion slot"))
            .count();
        if n >= want || t0.elapsed() > Duration::from_secs(10) {
            break n;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(done, want);
}

#[test]
fn serve_help_snapshot() {
    insta::assert_snapshot!(tool("mlb-serve").arg("--help").ok().stdout);
}

/// Writing to the server without reading its answers leaves it serving others.
#[test]
fn serve_survives_a_client_that_never_reads() {
    let s = start(&[]);
    let addr = s.url.trim_start_matches("http://").to_string();
    let mut raw = std::net::TcpStream::connect(&addr).unwrap();
    let body = json!({"prompt": "A", "max_tokens": 100, "stream": true}).to_string();
    write!(
        raw,
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // Half a request on another connection.
    let mut half = std::net::TcpStream::connect(&addr).unwrap();
    write!(
        half,
        "POST /v1/completions HTTP/1.1\r\ncontent-length: 100\r\n\r\n{{\"pro"
    )
    .unwrap();
    s.assert_serves();
    drop(raw);
    drop(half);
    s.wait_idle();
}

/// `serve::step_all` (the scheduler's one model call per step, which the batched
/// engine's `feed_batch` replaces) leaves every session with the bits it gets fed
/// alone: uneven lists (a prefill chunk, a decode id, nothing) over every synthetic
/// case, for several steps.
#[test]
fn serve_step_all_gives_each_session_its_solo_bits() {
    use krafla::model::Packs;
    use krafla::session::Engine;

    use crate::run::opts;

    for c in crate::run::cases() {
        let e = Engine::new(crate::run::load(&c, 5), Packs::none(), None).unwrap();
        let o = opts(64);
        // Per session, per step: the ids fed (empty: the session sits the step out).
        let plan: Vec<Vec<Vec<u32>>> = (0..3u64)
            .map(|k| {
                let t = crate::run::tokens(c.h.vocab, 12, 7 + k);
                match k {
                    0 => vec![t[..9].to_vec(), t[9..10].to_vec(), t[10..11].to_vec()],
                    1 => vec![t[..1].to_vec(), vec![], t[1..5].to_vec()],
                    _ => vec![vec![], t[..3].to_vec(), t[3..4].to_vec()],
                }
            })
            .collect();
        let mut batch: Vec<_> = (0..3).map(|_| e.session(&o).unwrap()).collect();
        let mut solo: Vec<_> = (0..3).map(|_| e.session(&o).unwrap()).collect();
        for step in 0..3 {
            let ids: Vec<&[u32]> = plan.iter().map(|p| p[step].as_slice()).collect();
            let mut refs: Vec<_> = batch.iter_mut().collect();
            krafla::serve::step_all(&mut refs, &ids).unwrap();
            for (k, s) in solo.iter_mut().enumerate() {
                if !ids[k].is_empty() {
                    s.feed(ids[k]).unwrap();
                }
                let bits = |l: Option<&[f32]>| {
                    l.map(|l| l.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
                };
                assert_eq!(
                    bits(batch[k].logits()),
                    bits(s.logits()),
                    "{}: session {k} step {step}",
                    c.name
                );
                assert_eq!(batch[k].tokens(), s.tokens());
            }
        }
    }
}

/// tests/openai_client.py: the official `openai` Python package against mlb-serve
/// (models, chat, chat stream, completions, completions stream, logprobs, structured
/// output through `parse` and the stream helper, tool calls required, named, auto and
/// parallel, typed errors, SIGTERM exit 0). Needs `KRAFLA_OPENAI_PYTHON` naming a python with `openai`
/// installed; `.ci/run` makes that venv and sets it. Skipped (with a message) without, or
/// set to the empty string (as `KRAFLA_OPENAI_PYTHON= cargo test` reads: unset).
#[test]
fn serve_openai_python_client() {
    let py = std::env::var_os("KRAFLA_OPENAI_PYTHON").filter(|p| !p.is_empty());
    let Some(py) = py else {
        eprintln!(
            "serve_openai_python_client: skipped (set KRAFLA_OPENAI_PYTHON to a python with the openai package; .ci/run does)"
        );
        return;
    };
    let bins = bin_path("mlb-serve").parent().unwrap().to_path_buf();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai_client.py");
    let o = Command::new(&py)
        .arg(&script)
        .arg(&bins)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", Path::new(&py).display()));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{}\n{}",
        out,
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains("all checks ok"), "{out}");
}

/// SIGINT as SIGTERM, and a second one cancels what still runs: the stream still ends
/// in `[DONE]` (finished, or with the shutdown error event), and the exit is clean (0,
/// not death by the signal).
#[cfg(unix)]
#[test]
fn serve_sigint_twice_cancels_and_exits_0() {
    let mut s = start(&["--parallel", "1"]);
    let (_, lines) = s.long_stream_started(250);
    for _ in 0..2 {
        s.signal(libc::SIGINT);
        std::thread::sleep(Duration::from_millis(20));
    }
    let data: Vec<String> = lines
        .map_while(Result::ok)
        .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
        .collect();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    if let Some(err) = data.iter().find(|d| d.starts_with("{\"error\"")) {
        assert!(err.contains("shutting down"), "{err}");
    }
    s.assert_shut_down();
}

// ------------------------------------------------------------------------ issue 42

/// A tokenizer whose template renders `HOSTILE_TEMPLATES[probe]` when the request's
/// `chat_template_kwargs` name a `probe`, else [`TEMPLATE`].
fn probe_tokenizer() -> PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let mut src = String::new();
        for (i, t) in crate::util::hostile_templates().into_iter().enumerate() {
            src.push_str(&format!("{{% if probe == {i} %}}{t}{{% endif %}}"));
        }
        src.push_str(&format!(
            "{{% if probe is not defined %}}{TEMPLATE}{{% endif %}}"
        ));
        let dir = files().mlb.parent().unwrap().to_path_buf();
        let jinja = dir.join("probes.jinja");
        std::fs::write(&jinja, src).unwrap();
        let out = dir.join("probes.mlt");
        tool("mlt-convert")
            .arg(testdata().join("default/tokenizer.json"))
            .arg("-o")
            .arg(&out)
            .arg("--chat-template")
            .arg(&jinja)
            .arg("-q")
            .ok();
        out
    })
    .clone()
}

/// Peak resident memory (VmHWM) of a process, KiB.
fn peak_kib(pid: i32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let l = s.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    l.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Issue 42, 1: every hostile template answers a JSON error (400 or 500) and the
/// server stays up (before: it died on the first, a 4 GB allocation); eight renders of
/// the string-doubling template at once stay within the memory of two (renders wait
/// for one of the per-core permits, each has its budget; before: 2.5 GiB for one).
#[test]
fn serve_hostile_templates_are_errors_and_the_server_stays_up() {
    let tok = probe_tokenizer();
    let s = start(&[
        "--tokenizer",
        tok.to_str().unwrap(),
        "--parallel",
        "2",
        "--queue",
        "8",
    ]);
    let chat = |probe: Option<usize>| {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
        if let Some(p) = probe {
            body["chat_template_kwargs"] = json!({ "probe": p });
        }
        s.post("/v1/chat/completions", &body.to_string())
    };
    assert_eq!(chat(None).status, 200);
    for i in 0..crate::util::hostile_templates().len() {
        let t0 = Instant::now();
        let r = chat(Some(i));
        assert!(
            r.status == 400 || r.status == 500,
            "probe {i}: {} {}",
            r.status,
            r.body
        );
        let e = r.error(r.status);
        let m = e["message"].as_str().unwrap();
        assert!(
            m.contains("render budget") || m.contains("namespace"),
            "probe {i}: {m}"
        );
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "probe {i}: {:?}",
            t0.elapsed()
        );
        assert_eq!(s.get("/health").status, 200, "probe {i}");
    }
    std::thread::scope(|sc| {
        for _ in 0..8 {
            sc.spawn(|| assert_eq!(chat(Some(5)).status, 500));
        }
    });
    assert_eq!(chat(None).status, 200);
    let peak = peak_kib(s.pid());
    eprintln!("peak RSS after the probes: {} MiB", peak / 1024);
    assert!(peak < 1536 * 1024, "peak RSS {} MiB", peak / 1024);
}

/// Issue 42, 2: client mistakes in messages are 400 naming the field, not 500; an
/// assistant message with `content: null` beside `tool_calls` is accepted.
#[test]
fn serve_message_shapes_are_client_errors() {
    let s = start(&[]);
    for (msg, param) in [
        (json!({"role": "user", "content": 5}), "messages[0].content"),
        (
            json!({"role": "user", "content": {"a": 1}}),
            "messages[0].content",
        ),
        (
            json!({"role": "user", "content": null}),
            "messages[0].content",
        ),
        (json!({"role": "user"}), "messages[0].content"),
        (
            json!({"role": "user", "content": [5]}),
            "messages[0].content[0]",
        ),
        (
            json!({"role": "user", "content": "x", "name": 3}),
            "messages[0].name",
        ),
        (
            json!({"role": "assistant", "content": null}),
            "messages[0].content",
        ),
    ] {
        let body = json!({"messages": [msg], "max_tokens": 1});
        let r = s.post("/v1/chat/completions", &body.to_string());
        let e = r.error(400);
        assert_eq!(e["param"], param, "{msg}: {}", r.body);
    }
    let calls = json!({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    ], "max_tokens": 1});
    let r = s.post("/v1/chat/completions", &calls.to_string());
    assert_eq!(r.status, 200, "{}", r.body);
    s.assert_serves();
}

/// Issue 42, 3: numeric flags out of range are one line (before: `--queue 2^64-1`
/// wrapped `parallel + queue` to 0 and every request got 503).
#[test]
fn serve_numeric_flags_are_range_checked() {
    for (args, code, want) in [
        (
            vec!["--queue", "18446744073709551615"],
            1,
            "--queue = 18446744073709551615: at most 65536",
        ),
        (
            vec!["--parallel", "256", "--queue", "18446744073709551615"],
            1,
            "--queue",
        ),
        (
            vec!["--max-body", "99999999999999999999999"],
            2,
            "--max-body",
        ),
        (vec!["--prefill-chunk", "0"], 2, "--prefill-chunk"),
        (vec!["--max-connections", "0"], 2, "--max-connections"),
        (vec!["--header-timeout", "100000"], 2, "--header-timeout"),
        (vec!["--body-timeout", "-1"], 2, "--body-timeout"),
        (vec!["--template-fuel", "5"], 2, "--template-fuel"),
    ] {
        let (c, err) = match try_start(&args) {
            Ok(_) => panic!("{args:?} started"),
            Err(e) => e,
        };
        assert_eq!(c, Some(code), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(
            err.starts_with("mlb-serve: ") && err.contains(want),
            "{args:?}: {err}"
        );
    }
}

fn raise_own_fd_limit(want: u64) -> bool {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: valid rlimit pointers.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) != 0 || r.rlim_max < want as libc::rlim_t {
            return false;
        }
        r.rlim_cur = r.rlim_cur.max(want as libc::rlim_t);
        libc::setrlimit(libc::RLIMIT_NOFILE, &r) == 0
    }
}

fn fd_limit_1024() -> std::io::Result<()> {
    let l = libc::rlimit {
        rlim_cur: 1024,
        rlim_max: 1024,
    };
    // SAFETY: setrlimit with a valid rlimit.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &l) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Issue 42, 4: under a 1024-descriptor limit, 1,100 connections that send nothing do
/// not lock other clients out: /health answers within a second while they are open
/// (before: no answer for as long as they stayed open).
#[cfg(unix)]
#[test]
fn serve_idle_connections_do_not_starve_others() {
    if !raise_own_fd_limit(1400) {
        eprintln!("skipped: cannot open 1,100 connections here (RLIMIT_NOFILE)");
        return;
    }
    let s = try_start_with(&[], Some(fd_limit_1024)).unwrap_or_else(|e| panic!("{e:?}"));
    let addr = s.url.trim_start_matches("http://").to_string();
    let idle: Vec<std::net::TcpStream> = (0..1100)
        .filter_map(|_| std::net::TcpStream::connect(&addr).ok())
        .collect();
    assert!(idle.len() > 1000, "{} connected", idle.len());
    std::thread::sleep(Duration::from_millis(200));
    let quick = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(3)))
        .build();
    let quick: ureq::Agent = quick.into();
    let mut worst = Duration::ZERO;
    for _ in 0..5 {
        let t0 = Instant::now();
        let r = quick.get(format!("{}/health", s.url)).call();
        let took = t0.elapsed();
        assert!(
            r.as_ref().is_ok_and(|r| r.status() == 200),
            "{r:?} after {took:?}"
        );
        worst = worst.max(took);
    }
    eprintln!("/health with 1,100 idle connections open: worst {worst:?}");
    assert!(worst < Duration::from_secs(1), "{worst:?}");
    drop(idle);
    s.assert_serves();
}

/// Reads from `c` until EOF or an error; the bytes read.
fn read_to_close(c: &mut std::net::TcpStream, limit: Duration) -> (Vec<u8>, Duration) {
    c.set_read_timeout(Some(limit)).unwrap();
    let t0 = Instant::now();
    let mut buf = Vec::new();
    let _ = c.read_to_end(&mut buf);
    (buf, t0.elapsed())
}

/// Issue 42, 4: a connection that sends nothing, or half a head, is closed after
/// `--header-timeout`; a body shorter than its Content-Length gets 408 after
/// `--body-timeout` (before: all three stayed open).
#[test]
fn serve_head_and_body_timeouts() {
    let s = start(&["--header-timeout", "1", "--body-timeout", "1"]);
    let addr = s.url.trim_start_matches("http://").to_string();
    let mut silent = std::net::TcpStream::connect(&addr).unwrap();
    let mut half_head = std::net::TcpStream::connect(&addr).unwrap();
    half_head
        .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    let mut half_body = std::net::TcpStream::connect(&addr).unwrap();
    half_body
        .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pro")
        .unwrap();
    for (name, c) in [("silent", &mut silent), ("half head", &mut half_head)] {
        let (_, took) = read_to_close(c, Duration::from_secs(10));
        assert!(took < Duration::from_secs(5), "{name}: open for {took:?}");
    }
    let (got, took) = read_to_close(&mut half_body, Duration::from_secs(10));
    let got = String::from_utf8_lossy(&got);
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    s.assert_serves();
}

/// Issue 42, 5: SIGTERM ends the server while clients hold a half-sent head and a
/// half-sent body (before: it never did, even after a second signal).
#[cfg(unix)]
#[test]
fn serve_sigterm_ends_despite_half_sent_requests() {
    let mut s = start(&[]);
    let addr = s.url.trim_start_matches("http://").to_string();
    let mut a = std::net::TcpStream::connect(&addr).unwrap();
    a.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    let mut b = std::net::TcpStream::connect(&addr).unwrap();
    b.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    s.sigterm_exits_within(
        Duration::from_secs(8),
        "SIGTERM with two half-sent requests",
    );
}

/// Issue 42, 5: a second SIGTERM closes everything at once, a running stream and a
/// half-sent request included.
#[cfg(unix)]
#[test]
fn serve_second_sigterm_closes_everything_at_once() {
    let mut s = start(&["--parallel", "1"]);
    let addr = s.url.trim_start_matches("http://").to_string();
    let mut a = std::net::TcpStream::connect(&addr).unwrap();
    a.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
        .unwrap();
    let (_, lines) = s.long_stream_started(250);
    s.signal(libc::SIGTERM);
    std::thread::sleep(Duration::from_millis(300));
    s.sigterm_exits_within(Duration::from_secs(2), "the second SIGTERM");
    drop(lines);
}

/// Issue 42, 6: a prompt far over the context is refused before it is encoded (before:
/// 4 MiB of spaces were encoded first, seconds of CPU), as completion text and as a
/// chat message (the rendering stops at the bound).
#[test]
fn serve_prompt_far_over_the_context_is_refused_unencoded() {
    let s = start(&["--ctx", "64"]);
    let spaces = " ".repeat(4 << 20);
    for (path, body) in [
        (
            "/v1/completions",
            json!({"prompt": format!("{spaces}x"), "max_tokens": 1}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": format!("{spaces}x")}], "max_tokens": 1}),
        ),
    ] {
        let t0 = Instant::now();
        let r = s.post(path, &body.to_string());
        let took = t0.elapsed();
        let e = r.error(400);
        assert_eq!(e["code"], "context_length_exceeded", "{path}: {}", r.body);
        assert!(took < Duration::from_secs(2), "{path}: {took:?}");
    }
    s.assert_serves();
}

/// Structured output and tool calls (tests/serve/structured.rs).
mod structured;

// Issue 45: embeddings, /metrics, the context in /v1/models, speculative decoding.

/// The library's embedding of `ids` alone (not normalized): a fresh session of the
/// same model file.
fn library_embedding(ids: &[u32], pooling: krafla::session::Pooling) -> Vec<f32> {
    use krafla::session::{Engine, LoadOptions};
    let e = Engine::load(&LoadOptions::new(&files().mlb)).unwrap();
    let mut s = e.session(&krafla::model::StateOptions::default()).unwrap();
    s.embed(ids, pooling).unwrap()
}

/// A checkpoint with sentence-transformers' pooling config (mean) converts to a file
/// whose header names it (mlb-inspect shows it); mlb-serve pools so, `--pooling`
/// overriding.
#[test]
fn serve_pools_as_the_model_says() {
    use krafla::session::Pooling;
    let dir = files().mlb.parent().unwrap().join("pooled");
    let hf = copy_files(
        &testdata().join("default"),
        &dir.join("hf"),
        &[
            "model.safetensors",
            "config.json",
            "tokenizer.json",
            "tokenizer_config.json",
        ],
    );
    std::fs::create_dir_all(hf.join("1_Pooling")).unwrap();
    std::fs::write(
        hf.join("modules.json"),
        r#"[{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]"#,
    )
    .unwrap();
    std::fs::write(
        hf.join("1_Pooling/config.json"),
        r#"{"word_embedding_dimension": 64, "pooling_mode_cls_token": false, "pooling_mode_mean_tokens": true, "pooling_mode_lasttoken": false}"#,
    )
    .unwrap();
    let mlb = dir.join("pooled.mlb");
    convert(&hf, &mlb, &["--wtype", "q8_0"]);
    let o = tool("mlb-inspect").arg(&mlb).ok();
    assert!(
        o.stdout
            .lines()
            .any(|l| l.trim_start().starts_with("pooling") && l.contains(" 1 ")),
        "{}",
        o.stdout
    );
    let ids = encode("The Python interpreter reads a file");
    let body = json!({"input": [ids], "encoding_format": "base64", "normalize": false}).to_string();
    let chat = files().chat.to_str().unwrap().to_string();
    for (args, want) in [
        (vec![], Pooling::Mean),
        (vec!["--pooling", "last"], Pooling::Last),
        (vec!["--pooling", "cls"], Pooling::Cls),
    ] {
        let mut a = vec!["--tokenizer", chat.as_str()];
        a.extend(args);
        let s = try_start_model(&mlb, &a, None).unwrap_or_else(|(c, e)| panic!("{c:?}: {e}"));
        let r = s.post("/v1/embeddings", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        // The same weights as the default model's file: the library's embedding.
        assert_eq!(
            bits(&vector(&r.json()["data"][0]["embedding"])),
            bits(&library_embedding(&ids, want)),
            "{want}"
        );
    }
}

/// The default model's tokenizer (the chat `.mlt` beside the model).
fn encode(text: &str) -> Vec<u32> {
    krafla::tokenizer::Tokenizer::from_path(&files().chat)
        .unwrap()
        .encode(text)
}

/// Standard base64 back to bytes.
fn unbase64(s: &str) -> Vec<u8> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("not base64: {c}"),
    };
    let mut out = Vec::new();
    for q in s.as_bytes().chunks(4) {
        let n = q
            .iter()
            .take_while(|&&c| c != b'=')
            .fold((0u32, 0usize), |(acc, k), &c| {
                (acc | u32::from(val(c)) << (18 - 6 * k), k + 1)
            });
        let bytes = [(n.0 >> 16) as u8, (n.0 >> 8) as u8, n.0 as u8];
        out.extend_from_slice(&bytes[..n.1.saturating_sub(1)]);
    }
    out
}

/// An embedding of a response: base64 f32 bytes or a list of numbers.
fn vector(v: &Value) -> Vec<f32> {
    match v {
        Value::String(s) => unbase64(s)
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Value::Array(a) => a.iter().map(|x| x.as_f64().unwrap() as f32).collect(),
        _ => panic!("not an embedding: {v}"),
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// /v1/embeddings: strings, token arrays, lists of either; base64 and float; the
/// vectors bit for bit the library's hidden state of each text alone, though the inputs
/// ran in three slots beside a streaming completion and another embedding request;
/// normalized to length 1 by default; `dimensions`; usage; errors.
#[test]
fn serve_embeddings() {
    use krafla::session::{l2_normalize, Pooling};
    let s = start(&["--parallel", "3"]);
    let texts = ["A function is", "The Python interpreter reads a file", "x"];
    let ids: Vec<Vec<u32>> = texts.iter().map(|t| encode(t)).collect();
    let want: Vec<Vec<f32>> = ids
        .iter()
        .map(|i| library_embedding(i, Pooling::Last))
        .collect();
    // A stream beside the embeddings, so that they share steps with it.
    let url = s.url.clone();
    let stream = std::thread::spawn(move || {
        let body = json!({"prompt": "A", "max_tokens": 40, "temperature": 0, "stream": true, "logit_bias": {"2": -100}});
        let r = agent()
            .post(format!("{url}/v1/completions"))
            .send(body.to_string())
            .unwrap();
        r.into_body().read_to_string().unwrap()
    });
    let url = s.url.clone();
    let other = std::thread::spawn(move || {
        let body = json!({"input": ["x", "A function is"], "encoding_format": "base64", "normalize": false});
        let mut r = agent()
            .post(format!("{url}/v1/embeddings"))
            .send(body.to_string())
            .unwrap();
        r.body_mut().read_to_string().unwrap()
    });
    let r = s.post(
        "/v1/embeddings",
        &json!({"model": "default", "input": texts, "encoding_format": "base64", "normalize": false})
            .to_string(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["model"], "default");
    let n: usize = ids.iter().map(Vec::len).sum();
    assert_eq!(v["usage"]["prompt_tokens"], n);
    assert_eq!(v["usage"]["total_tokens"], n);
    for (i, w) in want.iter().enumerate() {
        let d = &v["data"][i];
        assert_eq!(
            (d["object"].as_str(), d["index"].as_u64()),
            (Some("embedding"), Some(i as u64))
        );
        assert_eq!(bits(&vector(&d["embedding"])), bits(w), "input {i}");
    }
    let o: Value = serde_json::from_str(&other.join().unwrap()).unwrap();
    assert_eq!(bits(&vector(&o["data"][0]["embedding"])), bits(&want[2]));
    assert_eq!(bits(&vector(&o["data"][1]["embedding"])), bits(&want[0]));
    assert!(stream.join().unwrap().contains("[DONE]"));

    // Token ids (one list, and a list of lists), float, normalized by default.
    let mut unit = want[1].clone();
    l2_normalize(&mut unit);
    for input in [json!(ids[1]), json!([ids[1], ids[0]])] {
        let r = s.post("/v1/embeddings", &json!({"input": input}).to_string());
        assert_eq!(r.status, 200, "{}", r.body);
        let e = vector(&r.json()["data"][0]["embedding"]);
        assert_eq!(bits(&e), bits(&unit));
        let norm: f64 = e.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
        assert!((norm - 1.0).abs() < 1e-5, "{norm}");
    }
    let r = s.post(
        "/v1/embeddings",
        &json!({"input": "x", "dimensions": 8}).to_string(),
    );
    let e = vector(&r.json()["data"][0]["embedding"]);
    let mut cut = want[2][..8].to_vec();
    l2_normalize(&mut cut);
    assert_eq!(bits(&e), bits(&cut));

    for (body, param, code) in [
        (json!({"input": ""}), "input", None),
        (json!({"input": []}), "input", None),
        (json!({"input": [1, 1_000_000]}), "input", None),
        (
            json!({"input": "a", "encoding_format": "f16"}),
            "encoding_format",
            None,
        ),
        (
            json!({"input": "word ".repeat(2000)}),
            "input",
            Some("context_length_exceeded"),
        ),
    ] {
        let e = s.post("/v1/embeddings", &body.to_string()).error(400);
        assert_eq!(e["param"], param, "{body}");
        if let Some(c) = code {
            assert_eq!(e["code"], c, "{body}");
        }
    }
    s.assert_serves();
    assert!(s.log().contains("embedding slot"), "{}", s.log());
}

/// `--pooling mean`: the mean of every position's hidden state, as the library
/// computes it; not the last token's. A request's budget: at most 2048 inputs and
/// `--max-embed-tokens` ids over all of them (by bytes before encoding, by ids after),
/// else 400 naming `input`.
#[test]
fn serve_embeddings_mean_pooling() {
    use krafla::session::Pooling;
    let s = start(&[
        "--pooling",
        "mean",
        "--parallel",
        "2",
        "--max-embed-tokens",
        "64",
    ]);
    let ids = encode("The Python interpreter reads a file");
    let r = s.post(
        "/v1/embeddings",
        &json!({"input": [ids, [5, 6, 7]], "encoding_format": "base64", "normalize": false})
            .to_string(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let mean = library_embedding(&ids, Pooling::Mean);
    assert_eq!(bits(&vector(&v["data"][0]["embedding"])), bits(&mean));
    assert_ne!(bits(&mean), bits(&library_embedding(&ids, Pooling::Last)));
    assert_eq!(
        bits(&vector(&v["data"][1]["embedding"])),
        bits(&library_embedding(&[5, 6, 7], Pooling::Mean))
    );
    let fits = vec![vec![5u32; 30], vec![6; 34]];
    assert_eq!(
        s.post("/v1/embeddings", &json!({"input": fits}).to_string())
            .status,
        200
    );
    for (body, says) in [
        (
            json!({"input": vec![vec![5u32; 30], vec![6; 35]]}),
            "65 tokens",
        ),
        (json!({"input": vec!["x"; 2049]}), "2049 items"),
        (json!({"input": "word ".repeat(20_000)}), "bytes"),
    ] {
        let e = s.post("/v1/embeddings", &body.to_string()).error(400);
        assert_eq!(e["param"], "input");
        assert!(e["message"].as_str().unwrap().contains(says), "{e}");
    }
    s.assert_serves();
    let (code, err) = try_start(&["--pooling", "max"]).err().unwrap();
    assert_eq!(code, Some(2), "{err}");
}

/// Prometheus' text format, read strictly: `# HELP` / `# TYPE` before a family's
/// samples, names and labels well formed, values numbers, no series twice, histogram
/// buckets cumulative up to `+Inf` = `_count`. Returns series → value.
fn parse_prometheus(text: &str) -> std::collections::BTreeMap<String, f64> {
    use std::collections::{BTreeMap, HashMap};
    let name_ok = |n: &str| {
        !n.is_empty()
            && n.chars().enumerate().all(|(i, c)| {
                c.is_ascii_alphabetic() || c == '_' || c == ':' || (i > 0 && c.is_ascii_digit())
            })
    };
    let mut types: HashMap<String, String> = HashMap::new();
    let mut series: BTreeMap<String, f64> = BTreeMap::new();
    for line in text.lines() {
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# ") {
            let mut w = rest.splitn(3, ' ');
            let (kw, name) = (w.next().unwrap(), w.next().unwrap());
            assert!(name_ok(name), "{line}");
            match kw {
                "HELP" => assert!(w.next().is_some_and(|h| !h.is_empty()), "{line}"),
                "TYPE" => {
                    let t = w.next().unwrap();
                    assert!(
                        ["counter", "gauge", "histogram", "summary", "untyped"].contains(&t),
                        "{line}"
                    );
                    assert!(
                        types.insert(name.into(), t.into()).is_none(),
                        "TYPE twice: {line}"
                    );
                }
                _ => panic!("comment: {line}"),
            }
            continue;
        }
        let (key, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("{line}"));
        let name = key.split('{').next().unwrap();
        assert!(name_ok(name), "{line}");
        if let Some(labels) = key.strip_prefix(name).filter(|l| !l.is_empty()) {
            let inner = labels
                .strip_prefix('{')
                .and_then(|l| l.strip_suffix('}'))
                .unwrap_or_else(|| panic!("{line}"));
            // label="value" pairs, values with \\ \" \n escapes.
            let mut rest = inner;
            while !rest.is_empty() {
                let (l, after) = rest.split_once("=\"").unwrap_or_else(|| panic!("{line}"));
                assert!(name_ok(l), "{line}");
                let mut end = None;
                let mut esc = false;
                for (i, c) in after.char_indices() {
                    match (esc, c) {
                        (true, '\\' | '"' | 'n') => esc = false,
                        (true, _) => panic!("bad escape: {line}"),
                        (false, '\\') => esc = true,
                        (false, '"') => {
                            end = Some(i);
                            break;
                        }
                        _ => {}
                    }
                }
                let end = end.unwrap_or_else(|| panic!("{line}"));
                rest = after[end + 1..]
                    .strip_prefix(',')
                    .unwrap_or(&after[end + 1..]);
            }
        }
        let v = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            "NaN" => f64::NAN,
            v => v.parse().unwrap_or_else(|e| panic!("{line}: {e}")),
        };
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| {
                name.strip_suffix(s)
                    .filter(|f| types.get(*f).is_some_and(|t| t == "histogram"))
            })
            .unwrap_or(name);
        assert!(types.contains_key(family), "no TYPE before: {line}");
        assert!(series.insert(key.to_string(), v).is_none(), "twice: {line}");
    }
    for (fam, t) in &types {
        if t != "histogram" {
            continue;
        }
        let buckets: Vec<(&String, f64)> = series
            .iter()
            .filter(|(k, _)| k.starts_with(&format!("{fam}_bucket{{")))
            .map(|(k, &v)| (k, v))
            .collect();
        let mut le: Vec<(f64, f64)> = buckets
            .iter()
            .map(|(k, v)| {
                let b = k.split("le=\"").nth(1).unwrap().trim_end_matches("\"}");
                (
                    if b == "+Inf" {
                        f64::INFINITY
                    } else {
                        b.parse().unwrap()
                    },
                    *v,
                )
            })
            .collect();
        le.sort_by(|a, b| a.0.total_cmp(&b.0));
        assert!(
            le.windows(2).all(|w| w[0].1 <= w[1].1),
            "{fam}: buckets not cumulative"
        );
        assert_eq!(le.last().unwrap().0, f64::INFINITY, "{fam}");
        assert_eq!(
            Some(&le.last().unwrap().1),
            series.get(&format!("{fam}_count")),
            "{fam}"
        );
    }
    series
}

/// /metrics parses as Prometheus' text format and counts what was asked;
/// /v1/models tells the context.
#[test]
fn serve_metrics_and_the_context_in_models() {
    let s = start(&["--parallel", "2", "--ctx", "256"]);
    let m = s.get("/v1/models").json();
    assert_eq!(m["data"][0]["context_length"], 256, "{m}");
    assert_eq!(m["data"][0]["meta"]["n_ctx"], 256, "{m}");
    assert!(
        m["data"][0]["meta"]["n_ctx_train"].as_u64().unwrap() >= 256,
        "{m}"
    );
    let body = json!({"prompt": "A function is", "max_tokens": 5, "temperature": 0, "logit_bias": {"2": -100}});
    for _ in 0..2 {
        assert_eq!(s.post("/v1/completions", &body.to_string()).status, 200);
    }
    s.post("/v1/completions", "{").error(400);
    s.get("/nope").error(404);
    assert_eq!(
        s.post("/v1/embeddings", &json!({"input": "x"}).to_string())
            .status,
        200
    );
    s.wait_idle();
    let r = agent().get(format!("{}/metrics", s.url)).call().unwrap();
    let ct = r
        .headers()
        .get("content-type")
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    assert!(ct.starts_with("text/plain; version=0.0.4"), "{ct}");
    let text = r.into_body().read_to_string().unwrap();
    let m = parse_prometheus(&text);
    let get = |k: &str| *m.get(k).unwrap_or_else(|| panic!("no {k}:\n{text}"));
    assert_eq!(
        get("krafla_requests_total{route=\"/v1/completions\",status=\"200\"}"),
        2.0
    );
    assert_eq!(
        get("krafla_requests_total{route=\"/v1/completions\",status=\"400\"}"),
        1.0
    );
    assert_eq!(
        get("krafla_requests_total{route=\"other\",status=\"404\"}"),
        1.0
    );
    assert_eq!(
        get("krafla_requests_total{route=\"/v1/embeddings\",status=\"200\"}"),
        1.0
    );
    assert_eq!(get("krafla_generated_tokens_total"), 10.0);
    assert!(get("krafla_prompt_tokens_total") >= 1.0);
    assert_eq!(
        get("krafla_embedding_tokens_total"),
        encode("x").len() as f64
    );
    assert_eq!(get("krafla_time_to_first_token_seconds_count"), 2.0);
    assert!(get("krafla_time_to_first_token_seconds_sum") > 0.0);
    assert!(get("krafla_generated_tokens_per_second") > 0.0);
    assert_eq!(get("krafla_slots_total"), 2.0);
    assert_eq!(get("krafla_slots_busy"), 0.0);
    assert_eq!(get("krafla_requests_queued"), 0.0);
    assert_eq!(get("krafla_kv_cache_capacity_tokens"), 512.0);
    let used = get("krafla_kv_cache_used_tokens");
    assert!(used > 0.0 && used <= 512.0, "{used}");
    assert!((get("krafla_kv_cache_usage_ratio") - used / 512.0).abs() < 1e-9);
    assert_eq!(get("krafla_draft_tokens_total"), 0.0);
}

/// `--lookup` and `--draft` (a Q4_0 copy of the model): greedy answers are plain
/// decoding's (mlb-run's), two at once in one batch too, streamed or not; /metrics
/// counts drafts; a draft of another vocabulary is refused at start.
#[test]
fn serve_speculative_gives_the_plain_text() {
    let dir = files().mlb.parent().unwrap().join("draft");
    std::fs::create_dir_all(&dir).unwrap();
    let q4 = dir.join("q4.mlb");
    if !q4.exists() {
        convert(&testdata().join("default"), &q4, &["--wtype", "q4_0"]);
        std::fs::copy(&files().chat, dir.join("q4.mlt")).unwrap();
    }
    let prompts = [
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
        "A function is",
    ];
    let want: Vec<String> = prompts.iter().map(|p| mlb_run_greedy(p, 32)).collect();
    for args in [
        vec!["--lookup"],
        vec!["--draft", q4.to_str().unwrap(), "--draft-max", "4"],
    ] {
        let s = start(&[&["--parallel", "2"], &args[..]].concat());
        let ask = |url: String, p: &'static str| {
            std::thread::spawn(move || {
                let body = json!({"prompt": p, "max_tokens": 32, "temperature": 0});
                let mut r = agent()
                    .post(format!("{url}/v1/completions"))
                    .send(body.to_string())
                    .unwrap();
                let v: Value =
                    serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap();
                v["choices"][0]["text"].as_str().unwrap().to_string()
            })
        };
        let both: Vec<_> = prompts.iter().map(|&p| ask(s.url.clone(), p)).collect();
        for (h, w) in both.into_iter().zip(&want) {
            assert_eq!(&h.join().unwrap(), w, "{args:?}");
        }
        let data = s.stream(
            "/v1/completions",
            &json!({"prompt": prompts[0], "max_tokens": 32, "temperature": 0}),
        );
        assert_eq!(stream_text(&data).0, want[0], "{args:?} streamed");
        // Sampling speculates too (the acceptance rule: tests/speculative.rs and
        // model::sampler's verify_keeps_the_distribution): whole answers, every token
        // counted once.
        let body = json!({"prompt": prompts[0], "max_tokens": 24, "temperature": 0.8, "seed": 7, "logit_bias": {"2": -100}});
        let r = s.post("/v1/completions", &body.to_string());
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert_eq!(v["usage"]["completion_tokens"], 24, "{args:?}: {v}");
        assert_eq!(v["choices"][0]["finish_reason"], "length", "{args:?}: {v}");
        let text = s.get("/metrics").body;
        let m = parse_prometheus(&text);
        assert!(m["krafla_draft_tokens_total"] > 0.0, "{args:?}: {text}");
        assert!(
            m["krafla_draft_accepted_tokens_total"] > 0.0,
            "{args:?}: {text}"
        );
        assert!(s.log().contains("drafts kept"), "{}", s.log());
    }
    let other = dir.join("other.mlb");
    std::fs::write(
        &other,
        krafla::synth::synth_file(&crate::run::cases()[0].h, &[], 1),
    )
    .unwrap();
    let (code, err) = try_start(&["--draft", other.to_str().unwrap()])
        .err()
        .unwrap();
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--draft") && err.contains("vocab"), "{err}");
}
