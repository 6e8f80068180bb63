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
use std::process::{Command, Output, Stdio};

use krafla::chat::{capture, Chat, Message, RenderOptions};
use krafla::format::mlb::header::layer_flag;
use krafla::format::mlb::synth::synth_file;
use krafla::format::mlt::{Attr, Kind, Merge, Mlt, Token};
use krafla::format::mlt_chat::{NamedTemplate, STOP_END_OF_TURN, STOP_EOS, STOP_GENERATION_CONFIG};
use krafla::model::{Model, Options, Packs, SamplerOpts};
use krafla::session::{
    ChatEvent, ChatOptions, ChatSession, ChatSessionError, Engine, GenerateOptions, StopReason,
};
use krafla::tokenizer::Tokenizer;

use crate::run::{cases, load, tokens, Case};
use crate::util::{bin_path, stderr, stdout};

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
fn fresh(m: &Model, o: &Options, ids: &[u32]) -> Vec<f32> {
    let mut st = m.state(o).unwrap();
    m.prefill(&mut st, ids, None).unwrap().to_vec()
}

fn opts(ctx: usize) -> Options {
    Options {
        ctx: Some(ctx),
        ..Options::default()
    }
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

fn sampled(seed: u64) -> SamplerOpts {
    SamplerOpts {
        temp: 1.5,
        seed,
        ..SamplerOpts::default()
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
    let prompt = tokens(c.h.vocab, 6, 1);
    let run = |o: &GenerateOptions| {
        let mut s = e.session(&Options::default()).unwrap();
        s.feed(&prompt).unwrap();
        s.generate(o, |_| ControlFlow::Continue(())).unwrap()
    };
    // Forced by a logit bias: each stop id ends the generation at once, by default.
    for id in [IM_END, EOS, EOT, 10] {
        let o = GenerateOptions {
            max_tokens: 5,
            sampling: SamplerOpts {
                logit_bias: vec![(id, 100.0)],
                ..SamplerOpts::default()
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
    let o = Options::default();
    let go = ChatOptions {
        generate: GenerateOptions {
            max_tokens: 6,
            sampling: sampled(4),
            ..GenerateOptions::default()
        },
        ..ChatOptions::default()
    };
    let mut chat = ChatSession::new(&e, &o, go).unwrap();
    chat.set_system(Some("brief"));
    let mut before: Vec<Message> = chat.messages().to_vec();
    for (turn, text) in ["hi", "why?", "go on"]
        .into_iter()
        .enumerate()
    {
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
        assert_eq!(chat.messages().last().unwrap().content(), Some(&reply.text[..]));
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
