//! Chat generation (issue 17): the stop set ends generation at any of its ids, the
//! chat session prefills only each turn's new ids with the logits of a fresh prefill
//! (attention, sliding rings, Qwen3.5's delta rule), the context shift, and
//! `mlb-run --chat` (a pipe, one message, the interactive loop) with the sampler's flags.
//!
//! The models are the synthetic cases of `tests/run.rs` (vocab 96); the tokenizer is
//! made here: a byte-level vocabulary of 85 tokens with four added tokens
//! (`<|im_start|>`, `<|im_end|>`, `</s>`, `<|eot|>`) and a ChatML template, whose stop
//! set (as mlt-convert builds it) holds `</s>` (eos), `<|eot|>` (generation_config) and
//! `<|im_end|>` (the template's end of turn).

use std::collections::BTreeSet;
use std::ops::ControlFlow;
use std::path::Path;

use krafla::chat::{capture, Chat, Message, RenderOptions};
use krafla::format::mlb::header::layer_flag;
use krafla::format::mlt::{Attr, Kind, Merge, Mlt, Token};
use krafla::format::mlt_chat::{NamedTemplate, STOP_END_OF_TURN, STOP_EOS, STOP_GENERATION_CONFIG};
use krafla::model::{Model, Packs, SamplerOptions, StateOptions};
use krafla::session::{
    ChatEvent, ChatSession, ChatSessionError, ChatSessionOptions, Engine, GenerateOptions,
    StopReason,
};
use krafla::tokenizer::Tokenizer;

use crate::run::{cases, load, opts, tokens, write_case, Case};
use crate::util::tool::{tool, Tool};

const IM_START: u32 = 0;
const IM_END: u32 = 1;
const EOS: u32 = 2;
const EOT: u32 = 3;

/// ChatML, one line: every message as `<|im_start|>ROLE\nCONTENT<|im_end|>\n`.
const CHATML: &str = r"{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// ChatML whose generation prompt opens an empty think block that earlier turns do not
/// show (Qwen3 with `enable_thinking=false` renders history so): the common prefix of
/// two turns ends inside the previous turn's generation prompt.
const THINKING: &str = r"{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' }}{% endif %}";

/// The test tokenizer with `template` as its chat section.
fn test_mlt(template: &str) -> Mlt {
    let mut tokens: Vec<Token> = ["<|im_start|>", "<|im_end|>", "</s>", "<|eot|>"]
        .iter()
        .map(|t| Token {
            attr: Attr::Added,
            bytes: t.as_bytes().to_vec(),
        })
        .collect();
    let mut bytes: Vec<u8> = b"\n .,?!:'<>/|_-".to_vec();
    bytes.extend(b'a'..=b'z');
    bytes.extend(b'A'..=b'Z');
    bytes.extend(b'0'..=b'9');
    for b in bytes {
        tokens.push(Token {
            attr: Attr::Normal,
            bytes: vec![b],
        });
    }
    let id = |tokens: &[Token], s: &[u8]| tokens.iter().position(|t| t.bytes == s).unwrap() as u32;
    let mut merges = Vec::new();
    for (l, r) in [("t", "h"), ("th", "e"), ("i", "n"), (" ", "t"), ("e", "r")] {
        let (left, right) = (id(&tokens, l.as_bytes()), id(&tokens, r.as_bytes()));
        let merged = tokens.len() as u32;
        tokens.push(Token {
            attr: Attr::Normal,
            bytes: [l.as_bytes(), r.as_bytes()].concat(),
        });
        merges.push(Merge {
            left,
            right,
            merged,
        });
    }
    let mut m = Mlt {
        kind: Kind::ByteLevel,
        bos: None,
        eos: Some(EOS),
        flags: 32,
        tokens,
        merges,
        chat: None,
    };
    let section = capture::build_section(
        &m,
        vec![NamedTemplate {
            name: "default".into(),
            source: template.into(),
        }],
        vec![("eos_token".into(), "</s>".into())],
        &[EOT],
        &[],
    )
    .unwrap()
    .expect("a chat section");
    m.chat = Some(section);
    Mlt::parse(&m.to_bytes().unwrap()).unwrap()
}

/// The synthetic case's model with the test tokenizer and its chat section.
fn chat_engine(c: &Case, seed: u64, template: &str) -> Engine {
    let mlt = test_mlt(template);
    let tok = Tokenizer::from_mlt(&mlt).unwrap();
    Engine::new(load(c, seed), Packs::none(), Some(tok))
        .unwrap()
        .with_chat(Chat::from_mlt(&mlt).unwrap())
        .unwrap()
}

/// The logits of the last of `ids`, prefilled fresh.
fn fresh(m: &Model, o: &StateOptions, ids: &[u32]) -> Vec<f32> {
    let mut st = m.state(o).unwrap();
    m.prefill(&mut st, ids, None).unwrap().to_vec()
}

/// The prompt ids of `msgs` as `Chat::encode` renders them (the independent oracle).
fn encode(e: &Engine, msgs: &[Message], open: bool) -> Vec<u32> {
    let ro = RenderOptions {
        add_generation_prompt: !open,
        continue_final_message: open,
        ..RenderOptions::default()
    };
    e.chat()
        .unwrap()
        .encode(e.tokenizer().unwrap(), msgs, &ro)
        .unwrap()
}

fn common(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn quiet(_: ChatEvent<'_>) -> ControlFlow<()> {
    ControlFlow::Continue(())
}

fn sampled(seed: u64) -> SamplerOptions {
    SamplerOptions {
        temp: 1.5,
        seed,
        ..SamplerOptions::default()
    }
}

/// Chat options: at most `max_tokens` per reply, sampled as `sampled(4)`.
fn sampled_chat(max_tokens: usize) -> ChatSessionOptions {
    ChatSessionOptions {
        generate: GenerateOptions {
            max_tokens,
            sampling: sampled(4),
            ..GenerateOptions::default()
        },
        ..ChatSessionOptions::default()
    }
}

#[test]
fn the_stop_set_has_every_source_and_each_id_stops() {
    let mlt = test_mlt(CHATML);
    let stop = &mlt.chat.as_ref().unwrap().stop;
    let src = |id| stop.iter().find(|t| t.id == id).map(|t| t.sources);
    assert_eq!(src(EOS), Some(STOP_EOS));
    assert_eq!(src(EOT), Some(STOP_GENERATION_CONFIG));
    assert_eq!(src(IM_END), Some(STOP_END_OF_TURN));
    let c = &cases()[0];
    let e = chat_engine(c, 3, CHATML);
    assert_eq!(e.stop_ids(), vec![IM_END, EOS, EOT]);
    assert!(
        !e.stop_ids().contains(&IM_START),
        "a turn's start is no stop"
    );
    let prompt = tokens(c.h.vocab, 6, 1);
    let run = |o: &GenerateOptions| {
        let mut s = e.session(&StateOptions::default()).unwrap();
        s.feed(&prompt).unwrap();
        s.generate(o, |_| ControlFlow::Continue(())).unwrap()
    };
    // Forced by a logit bias: each stop id ends the generation at once, by default.
    for id in [IM_END, EOS, EOT, 10] {
        let o = GenerateOptions {
            max_tokens: 5,
            sampling: SamplerOptions {
                logit_bias: vec![(id, 100.0)],
                ..SamplerOptions::default()
            },
            ..GenerateOptions::default()
        };
        let g = run(&o);
        if id == 10 {
            assert_eq!((g.stop, g.tokens), (StopReason::Length, vec![10; 5]));
            continue;
        }
        assert_eq!((g.stop, &g.tokens[..]), (StopReason::StopId(id), &[id][..]));
        let g = run(&GenerateOptions {
            ignore_eos: true,
            ..o.clone()
        });
        assert_eq!((g.stop, g.tokens), (StopReason::Length, vec![id; 5]));
        // ignore_eos keeps the caller's own stop ids.
        let g = run(&GenerateOptions {
            ignore_eos: true,
            stop_ids: vec![id],
            ..o
        });
        assert_eq!(g.stop, StopReason::StopId(id));
    }
    // Sampled freely: the generation ends at the first id of the set, whichever it is.
    let mut seen = BTreeSet::new();
    for seed in 0..40 {
        let free = GenerateOptions {
            max_tokens: 40,
            sampling: sampled(seed),
            ignore_eos: true,
            ..GenerateOptions::default()
        };
        let all = run(&free).tokens;
        let g = run(&GenerateOptions {
            ignore_eos: false,
            ..free
        });
        match all.iter().position(|t| e.stop_ids().contains(t)) {
            Some(k) => {
                assert_eq!(g.tokens, all[..=k], "seed {seed}");
                assert_eq!(g.stop, StopReason::StopId(all[k]));
                seen.insert(all[k]);
            }
            None => assert_eq!(g.tokens, all),
        }
    }
    assert_eq!(seen.len(), 3, "every stop id ended a generation: {seen:?}");
}

/// Each turn of a conversation: the logits after the turn's prompt equal a fresh
/// prefill of the whole rendered conversation, and only ids after what the session
/// could keep are prefilled.
fn turns_match_a_fresh_prefill(c: &Case, template: &str) {
    let e = chat_engine(c, 21, template);
    let o = StateOptions::default();
    let go = sampled_chat(6);
    let mut chat = ChatSession::new(&e, &o, go).unwrap();
    chat.set_system(Some("brief"));
    let mut before: Vec<Message> = chat.messages().to_vec();
    for (turn, text) in ["hi", "why?", "go on"].into_iter().enumerate() {
        chat.push(Message::new("user", text));
        let info = chat.prefill().unwrap();
        let ids = encode(&e, chat.messages(), false);
        let want = fresh(e.model(), &o, &ids);
        assert!(
            chat.session().logits().unwrap() == want,
            "{} turn {turn}: logits differ from a fresh prefill",
            c.name
        );
        assert_eq!(chat.session().tokens(), &ids[..]);
        assert_eq!(info.tokens, ids.len());
        // What this turn can keep at least: the conversation before the previous
        // reply, without a generation prompt (a snapshot was taken there).
        let kept = match turn {
            // Nothing was in the session before the first turn.
            0 => 0,
            _ => common(&ids, &encode_plain(&e, &before)),
        };
        assert!(turn == 0 || kept > 0);
        assert!(
            info.fed <= ids.len() - kept,
            "{} turn {turn}: fed {} of {} ids; {kept} could be kept",
            c.name,
            info.fed,
            ids.len()
        );
        assert!(info.reused >= kept, "{}: {info:?}", c.name);
        if !c.flags.contains(&layer_flag::LINEAR) && c.h.sliding_window == 0 {
            // Attention alone rewinds for free: nothing is fed twice.
            assert_eq!(info.fed, ids.len() - info.reused, "{}", c.name);
        }
        before = chat.messages().to_vec();
        let reply = chat.respond(quiet).unwrap();
        assert_eq!(reply.prompts[0].fed, 0, "the prompt was in the session");
        assert!(!reply.tokens.is_empty());
        assert_eq!(chat.messages().last().unwrap().role(), "assistant");
        assert_eq!(
            chat.messages().last().unwrap().content(),
            Some(&reply.text[..])
        );
    }
}

fn encode_plain(e: &Engine, msgs: &[Message]) -> Vec<u32> {
    let ro = RenderOptions::default();
    e.chat()
        .unwrap()
        .encode(e.tokenizer().unwrap(), msgs, &ro)
        .unwrap()
}

#[test]
fn each_turn_prefills_only_its_new_ids_with_the_bits_of_a_fresh_prefill() {
    for c in cases() {
        turns_match_a_fresh_prefill(&c, CHATML);
        turns_match_a_fresh_prefill(&c, THINKING);
    }
}

/// A conversation over a small context with `context_shift`: `say` each of `turns`,
/// checking after each prefill that the logits are those of a fresh prefill of what is
/// rendered. Returns the messages each turn's context shift dropped.
fn shifting(c: &Case, ctx: usize, turns: &[&str]) -> Vec<usize> {
    let e = chat_engine(c, 21, CHATML);
    let o = opts(ctx);
    let go = ChatSessionOptions {
        context_shift: true,
        ..sampled_chat(4)
    };
    let mut chat = ChatSession::new(&e, &o, go).unwrap();
    chat.set_system(Some("brief"));
    let mut dropped = Vec::new();
    for text in turns {
        let before = chat.messages().len();
        chat.push(Message::new("user", text));
        let info = chat.prefill().unwrap();
        let ids = encode(&e, chat.messages(), false);
        assert_eq!(chat.session().tokens(), &ids[..], "{}", c.name);
        assert!(
            chat.session().logits().unwrap() == fresh(e.model(), &o, &ids),
            "{}: logits after a context shift differ from a fresh prefill",
            c.name
        );
        assert!(ids.len() + 4 <= ctx);
        assert_eq!(
            chat.messages()[0].content(),
            Some("brief"),
            "the system prompt stays"
        );
        assert_eq!(chat.messages().len(), before + 1 - info.dropped);
        dropped.push(info.dropped);
        chat.respond(quiet).unwrap();
    }
    dropped
}

#[test]
fn the_context_shift_drops_the_oldest_turns_and_keeps_the_bits() {
    let turns = ["hi", "why?", "go on", "and?", "more", "ok", "then?"];
    for c in [&cases()[0], &cases()[1], &cases()[7]] {
        let dropped = shifting(c, 64, &turns);
        // Whole turns go: a user message and its reply.
        assert!(
            dropped.iter().all(|d| d % 2 == 0),
            "{}: {dropped:?}",
            c.name
        );
        assert!(
            dropped.iter().sum::<usize>() >= 4,
            "{}: {dropped:?}",
            c.name
        );
        assert_eq!(dropped[0], 0);
    }
}

#[test]
fn a_full_context_refuses_the_turn_and_keeps_the_conversation() {
    let c = &cases()[0];
    let e = chat_engine(c, 21, CHATML);
    let go = sampled_chat(4);
    let mut chat = ChatSession::new(&e, &opts(64), go).unwrap();
    let mut refused = None;
    for text in ["hi", "why?", "go on", "and?", "more", "ok"] {
        let before = chat.messages().to_vec();
        match chat.say(text, quiet) {
            Ok(_) => {}
            Err(err) => {
                assert_eq!(chat.messages(), &before[..], "the turn left no trace");
                refused = Some(err);
                break;
            }
        }
    }
    let err = refused.expect("the context filled up");
    assert!(
        matches!(
            err,
            ChatSessionError::ContextFull {
                ctx: 64,
                shift: false,
                ..
            }
        ),
        "{err:?}"
    );
    let line = err.to_string();
    assert!(
        !line.contains('\n') && line.contains("--context-shift"),
        "{line}"
    );
}

#[test]
fn a_reply_cut_by_the_context_goes_on_after_the_shift() {
    for c in [&cases()[0], &cases()[7]] {
        let e = chat_engine(c, 21, CHATML);
        let go = ChatSessionOptions {
            generate: GenerateOptions {
                max_tokens: 200,
                sampling: sampled(4),
                ignore_eos: true,
                ..GenerateOptions::default()
            },
            context_shift: true,
            ..ChatSessionOptions::default()
        };
        // Room for a reply: a quarter of the context, 24; the prompt is about 50 ids.
        let mut chat = ChatSession::new(&e, &opts(96), go).unwrap();
        chat.set_system(Some("brief"));
        chat.push(Message::new("user", "hi"));
        chat.push(Message::new("assistant", "hello"));
        let reply = chat.say("why?", quiet).unwrap();
        assert_eq!(reply.prompts.len(), 2, "{}: {:?}", c.name, reply.prompts);
        let second = &reply.prompts[1];
        assert!(second.continued && second.dropped == 2, "{second:?}");
        // Then nothing older is left to drop: the reply ends at the full context.
        assert_eq!(reply.stop, StopReason::ContextFull);
        let roles: Vec<&str> = chat.messages().iter().map(|m| m.role()).collect();
        assert_eq!(roles, ["system", "user", "assistant"]);
        assert_eq!(chat.messages()[2].content(), Some(&reply.text[..]));
        assert_eq!(reply.prompts[0].dropped, 0);
        assert!(reply.tokens.len() > 40, "{}", reply.tokens.len());
    }
}

/// Seeded chat replies are the same on every tier and thread count (the delta rule
/// included).
#[test]
fn chat_replies_are_the_same_on_every_tier_and_thread_count() {
    use krafla::kernels::{self, pool::Pool, Tier};
    for c in [&cases()[4], &cases()[7]] {
        let e = chat_engine(c, 21, CHATML);
        let run = || {
            let go = ChatSessionOptions {
                generate: GenerateOptions {
                    max_tokens: 12,
                    sampling: SamplerOptions {
                        temp: 1.5,
                        seed: 9,
                        min_p: 0.01,
                        repeat_penalty: 1.2,
                        ..SamplerOptions::default()
                    },
                    ..GenerateOptions::default()
                },
                ..ChatSessionOptions::default()
            };
            let mut chat = ChatSession::new(&e, &StateOptions::default(), go).unwrap();
            ["hi", "why?"]
                .map(|t| chat.say(t, quiet).unwrap().tokens)
                .concat()
        };
        let base = Pool::leak(1)
            .install(|| kernels::with_tier(Tier::Scalar, run))
            .unwrap();
        assert!(base.len() > 4, "{}: {base:?}", c.name);
        for t in kernels::supported_tiers() {
            for threads in [1, 2, 3] {
                let got = Pool::leak(threads)
                    .install(|| kernels::with_tier(t, run))
                    .unwrap();
                assert_eq!(got, base, "{}: tier {t}, {threads} threads", c.name);
            }
        }
    }
}

// mlb-run --chat, through the binary.

/// A temp dir with `m.mlb` (case 0, seed 21) and `m.mlt` (the test tokenizer with
/// `template`, or none).
fn chat_files(template: Option<&str>) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_case(dir.path(), 0, 21);
    let mut mlt = test_mlt(template.unwrap_or(CHATML));
    if template.is_none() {
        mlt.chat = None;
        mlt.flags = 32;
    }
    std::fs::write(dir.path().join("m.mlt"), mlt.to_bytes().unwrap()).unwrap();
    dir
}

/// mlb-run on `dir/m.mlb` with `args`, `input` on stdin, to run.
fn mlb_run(dir: &Path, args: &[&str], input: &str) -> Tool {
    let mut t = tool("mlb-run");
    t.arg(dir.join("m.mlb")).args(args).stdin(input);
    t
}

const SEEDED: [&str; 7] = ["--chat", "--temp", "1.5", "--seed", "4", "-n", "24"];

/// The reply the library gives to `msgs` with mlb-run's default sampler and SEEDED.
fn library_reply(msgs: &[(&str, &str)], ignore_eos: bool) -> krafla::session::Reply {
    let e = chat_engine(&cases()[0], 21, CHATML);
    let defaults = krafla::tools::run::options::RunOptions::new("m.mlb");
    let go = ChatSessionOptions {
        generate: GenerateOptions {
            max_tokens: 24,
            sampling: SamplerOptions {
                temp: 1.5,
                seed: 4,
                ..defaults.sampling
            },
            ignore_eos,
            ..GenerateOptions::default()
        },
        ..ChatSessionOptions::default()
    };
    let mut chat = ChatSession::new(&e, &StateOptions::default(), go).unwrap();
    for (role, text) in msgs {
        chat.push(Message::new(role, text));
    }
    chat.respond(quiet).unwrap()
}

#[test]
fn mlb_run_chat_from_a_pipe_gives_the_librarys_reply() {
    let dir = chat_files(Some(CHATML));
    let want = library_reply(&[("system", "brief"), ("user", "hi")], false);
    let json = r#"{"messages": [{"role": "system", "content": "brief"}, {"role": "user", "content": "hi"}]}"#;
    let o = mlb_run(dir.path(), &SEEDED, json).ok();
    assert_eq!(o.stdout, format!("{}\n", want.text));
    assert!(!want.tokens.is_empty());
    // --prompt and --system make the same conversation.
    let mut args = SEEDED.to_vec();
    args.extend(["--system", "brief", "--prompt", "hi"]);
    let p = mlb_run(dir.path(), &args, "").ok();
    assert_eq!(p.stdout, o.stdout);
    // The same on the scalar tier and 1 or 3 threads.
    for threads in ["1", "3"] {
        let mut a = SEEDED.to_vec();
        a.extend(["--threads", threads]);
        let s = mlb_run(dir.path(), &a, json)
            .env("KRAFLA_KERNEL", "scalar")
            .ok();
        assert_eq!(s.stdout, o.stdout, "scalar, {threads} threads");
    }
}

#[test]
fn mlb_run_chat_stop_strings_and_logprobs() {
    let dir = chat_files(Some(CHATML));
    let json = r#"{"messages": [{"role": "user", "content": "hi"}]}"#;
    let mut args = SEEDED.to_vec();
    args.push("--ignore-eos");
    let full = library_reply(&[("user", "hi")], true).text;
    let o = mlb_run(dir.path(), &args, json).ok();
    assert_eq!(o.stdout, format!("{full}\n"));
    // A stop string from the middle of the reply: the text ends before its first
    // occurrence.
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() >= 6, "{full:?}");
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let before = &full[..full.find(&stop).unwrap()];
    let mut a = args.clone();
    a.extend(["--stop", &stop]);
    let s = mlb_run(dir.path(), &a, json).ok();
    assert_eq!(s.stdout, format!("{before}\n"), "--stop {stop:?}");
    assert!(s.stderr.contains("(stop string)"), "{}", s.stderr);
    // --logprobs 2: one JSON line per sampled token, with two alternatives.
    let mut a = args.clone();
    a.extend(["--logprobs", "2"]);
    let l = mlb_run(dir.path(), &a, json).ok();
    assert_eq!(l.stdout, o.stdout);
    let lines: Vec<serde_json::Value> = l
        .stderr
        .lines()
        .filter_map(|x| serde_json::from_str(x).ok())
        .collect();
    assert_eq!(lines.len(), 24, "{}", l.stderr);
    for v in &lines {
        assert!(v["logprob"].as_f64().unwrap() <= 0.0);
        assert_eq!(v["top"].as_array().unwrap().len(), 2);
    }
}

#[test]
fn mlb_run_chat_full_context_is_one_line_and_context_shift_goes_on() {
    let dir = chat_files(Some(CHATML));
    let mut msgs = vec![r#"{"role": "system", "content": "brief"}"#.to_string()];
    for i in 0..6 {
        msgs.push(format!(r#"{{"role": "user", "content": "question {i}"}}"#));
        msgs.push(format!(
            r#"{{"role": "assistant", "content": "answer {i}"}}"#
        ));
    }
    msgs.push(r#"{"role": "user", "content": "last"}"#.to_string());
    let json = format!(r#"{{"messages": [{}]}}"#, msgs.join(", "));
    let mut args = SEEDED.to_vec();
    args.extend(["--ctx", "96"]);
    let err = mlb_run(dir.path(), &args, &json).fails();
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("context full") && err.contains("--context-shift"),
        "{err}"
    );
    args.push("--context-shift");
    let s = mlb_run(dir.path(), &args, &json).ok();
    assert!(s.stderr.contains("dropped the"), "{}", s.stderr);
    assert!(s.stdout.ends_with('\n'));
}

#[test]
fn mlb_run_chat_interactive_lines_and_commands() {
    let dir = chat_files(Some(CHATML));
    let mut args = SEEDED.to_vec();
    args.extend(["--interactive", "--no-history", "--system", "brief"]);
    let input = "/help\nhi\n/undo\nhi\n/bogus\n/exit\nnot read\n";
    let o = mlb_run(dir.path(), &args, input).ok();
    let want = library_reply(&[("system", "brief"), ("user", "hi")], false).text;
    // The turn taken back and said again gets the same seeded reply.
    assert_eq!(o.stdout, format!("{want}\n{want}\n"));
    let err = o.stderr;
    assert!(
        err.contains("/reset") && err.contains("unknown command /bogus"),
        "{err}"
    );
}

#[test]
fn mlb_run_chat_needs_a_template() {
    let dir = chat_files(None);
    let json = r#"{"messages": [{"role": "user", "content": "hi"}]}"#;
    let err = mlb_run(dir.path(), &SEEDED, json).fails();
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("no chat template"), "{err}");
    // Bad conversation JSON names where it came from.
    let dir = chat_files(Some(CHATML));
    let err = mlb_run(dir.path(), &SEEDED, "{not json").fails();
    assert!(err.contains("stdin") && err.contains("not JSON"), "{err}");
}
