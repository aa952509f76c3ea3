//! An upper bound on how deep a YAML text nests, found in one pass without parsing it, so that
//! a deep text is refused before the parser sees it.
//!
//! The parser (libyaml, under serde_yaml) spends time in proportion to the open flow
//! collections (`[...]`, `{...}`) on every token it reads, so its cost grows with the square of
//! the flow depth: 100,000 levels in 200 KB took 38.5 s. The bound must therefore never be
//! below the depth libyaml reaches, whatever the quoting: a scan that took `a'` or `a#b` inside
//! a flow collection for the start of a quoted scalar or a comment stopped counting there, while
//! libyaml reads both as plain text and counts every bracket after them.
//!
//! Inside a flow collection, libyaml's tokens do not depend on indentation, so [`FlowDepth`]
//! follows its scanner there exactly: quoted scalars with their escapes, comments, plain
//! scalars, anchors and tags. Where the next character decides (`-` is an entry before a space
//! and text otherwise), it follows both readings, merging them by the deeper, which keeps the
//! pass linear. Outside, whether a bracket opens a collection depends on indentation (it may sit
//! in a quoted value, a comment or a block scalar), so every `[` or `{`, wherever it stands, is
//! also taken as a possible start. Brackets left open in a quoted value or a comment may thus be
//! counted as if they opened collections: an overcount, which a limit far above what the schema
//! needs allows.

/// Where libyaml's scanner can be inside a flow collection.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Lexer {
    /// Between tokens.
    Token,
    /// In a plain scalar, after a character that is not a space.
    Plain,
    /// In a plain scalar, after spaces or a line break: a `#` now starts a comment.
    PlainSpace,
    Single,
    /// After a `'` in a single-quoted scalar: another `'` is an escaped one, else it ended.
    SingleEnd,
    Double,
    /// After a `\` in a double-quoted scalar.
    DoubleEscape,
    Comment,
    /// An anchor's or alias's name.
    Anchor,
    /// Right after a tag's `!`.
    TagStart,
    /// In a verbatim tag, `!<...>`, which may hold `,`, `[` and `]`.
    Verbatim,
    /// In a tag, which ends at a space or a `,`.
    Tag,
}

const LEXERS: [Lexer; 12] = [
    Lexer::Token,
    Lexer::Plain,
    Lexer::PlainSpace,
    Lexer::Single,
    Lexer::SingleEnd,
    Lexer::Double,
    Lexer::DoubleEscape,
    Lexer::Comment,
    Lexer::Anchor,
    Lexer::TagStart,
    Lexer::Verbatim,
    Lexer::Tag,
];

/// What a character does to the depth.
#[derive(Clone, Copy)]
enum Nest {
    Keep,
    Open,
    Close,
}

/// The readings of one character: one, or two where the next character decides.
type Steps = [Option<(Lexer, Nest)>; 2];

fn one(lexer: Lexer) -> Steps {
    [Some((lexer, Nest::Keep)), None]
}

fn both(first: Lexer, second: Lexer) -> Steps {
    [Some((first, Nest::Keep)), Some((second, Nest::Keep))]
}

/// A space, a tab or a line break as libyaml knows them (NEL, LS and PS too, which end a
/// comment), or the NUL that ends its input.
fn is_space(c: char) -> bool {
    matches!(
        c,
        ' ' | '\t' | '\r' | '\n' | '\u{85}' | '\u{2028}' | '\u{2029}' | '\0'
    )
}

fn is_break(c: char) -> bool {
    is_space(c) && !matches!(c, ' ' | '\t')
}

/// The next readings of `c`, read in `lexer`'s state inside a flow collection.
fn step(lexer: Lexer, c: char) -> Steps {
    match lexer {
        Lexer::Token => token(c),
        Lexer::Plain => plain(c),
        Lexer::PlainSpace if c == '#' => one(Lexer::Comment),
        Lexer::PlainSpace => plain(c),
        Lexer::Single if c == '\'' => one(Lexer::SingleEnd),
        Lexer::Single => one(Lexer::Single),
        Lexer::SingleEnd if c == '\'' => one(Lexer::Single),
        Lexer::SingleEnd => token(c),
        Lexer::Double => one(match c {
            '"' => Lexer::Token,
            '\\' => Lexer::DoubleEscape,
            _ => Lexer::Double,
        }),
        Lexer::DoubleEscape => one(Lexer::Double),
        Lexer::Comment if is_break(c) => one(Lexer::Token),
        Lexer::Comment => one(Lexer::Comment),
        Lexer::Anchor if c.is_ascii_alphanumeric() || c == '_' || c == '-' => one(Lexer::Anchor),
        Lexer::Anchor => token(c),
        Lexer::TagStart if c == '<' => one(Lexer::Verbatim),
        Lexer::TagStart | Lexer::Tag if is_space(c) || c == ',' => token(c),
        Lexer::TagStart | Lexer::Tag => one(Lexer::Tag),
        Lexer::Verbatim if c == '>' => one(Lexer::Tag),
        Lexer::Verbatim => one(Lexer::Verbatim),
    }
}

/// A token's first character. A `#` starts a comment even right after a token, as in
/// libyaml; a character that starts no token is an error there, which ends the parse, so any
/// reading of it will do.
fn token(c: char) -> Steps {
    match c {
        '[' | '{' => [Some((Lexer::Token, Nest::Open)), None],
        ']' | '}' => [Some((Lexer::Token, Nest::Close)), None],
        ',' | '?' | ':' => one(Lexer::Token),
        '#' => one(Lexer::Comment),
        '\'' => one(Lexer::Single),
        '"' => one(Lexer::Double),
        '&' | '*' => one(Lexer::Anchor),
        '!' => one(Lexer::TagStart),
        // `- ` is an entry and `-x` a plain scalar; a byte-order mark is skipped at the start of
        // a line and is text elsewhere.
        '-' | '\u{feff}' => both(Lexer::Token, Lexer::Plain),
        c if is_space(c) => one(Lexer::Token),
        _ => one(Lexer::Plain),
    }
}

/// A plain scalar's next character: a flow indicator ends it, a `'`, `"` or `#` does not.
fn plain(c: char) -> Steps {
    match c {
        ',' | '[' | ']' | '{' | '}' => token(c),
        // Before a space `:` ends the scalar, before a flow indicator it is an error, else text.
        ':' => both(Lexer::Plain, Lexer::Token),
        c if is_space(c) => one(Lexer::PlainSpace),
        _ => one(Lexer::Plain),
    }
}

/// The flow depth of a text read so far, as an upper bound on libyaml's: per scanner state,
/// the deepest depth at which some reading of the text is in that state.
#[derive(Default)]
struct FlowDepth {
    /// By [`LEXERS`] index; 0 where no reading is (a reading at depth 0 is outside every
    /// collection, where every bracket starts a new one anyway).
    depths: [usize; LEXERS.len()],
    deepest: usize,
}

impl FlowDepth {
    fn read(&mut self, c: char) {
        let mut next = [0; LEXERS.len()];
        for (lexer, depth) in LEXERS.iter().zip(self.depths) {
            if depth == 0 {
                continue;
            }
            for (to, nest) in step(*lexer, c).into_iter().flatten() {
                let depth = match nest {
                    Nest::Keep => depth,
                    Nest::Open => depth + 1,
                    Nest::Close => depth - 1,
                };
                let slot = &mut next[to as usize];
                *slot = (*slot).max(depth);
            }
        }
        // Any bracket may open a collection in block context.
        if matches!(c, '[' | '{') {
            let slot = &mut next[Lexer::Token as usize];
            *slot = (*slot).max(1);
        }
        self.depths = next;
        self.deepest = self.deepest.max(self.current());
    }

    /// The deepest open collection now.
    fn current(&self) -> usize {
        self.depths.into_iter().max().unwrap_or(0)
    }

    /// The deepest open collection so far.
    fn deepest(&self) -> usize {
        self.deepest
    }
}

/// How deep the YAML in `text` nests: per line, its indentation (two columns a level) and its
/// leading `- ` and `? ` entries, on top of the flow collections open at its end; and the
/// deepest flow nesting anywhere. The flow depth, which the parser pays for, may be overcounted,
/// never undercounted. A file indented one column a level nests up to twice as deep as counted,
/// but the size limit keeps such a file under 1,500 levels, which the parser reads at once; the
/// compact `- - -` form, which packs a level into two bytes, is counted whole.
pub(super) fn nesting_depth(text: &str) -> usize {
    let mut flow = FlowDepth::default();
    let mut deepest = 0;
    for line in text.split_inclusive('\n') {
        line.chars().for_each(|c| flow.read(c));
        let line = line.trim_end_matches(['\r', '\n']);
        let indent = line.len() - line.trim_start_matches([' ', '\t']).len();
        let mut rest = line.trim_start();
        let mut entries = 0;
        while let Some(after) = rest.strip_prefix("- ").or_else(|| rest.strip_prefix("? ")) {
            entries += 1;
            rest = after.trim_start();
        }
        deepest = deepest.max(indent.div_ceil(2) + entries + flow.current());
    }
    deepest.max(flow.deepest())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nesting_depth_bounds_block_compact_and_flow_nesting() {
        assert_eq!(nesting_depth("sharing:\n  replicas: 1\n"), 1);
        assert_eq!(nesting_depth("dra-drivers:\n  - dra.net\n"), 2);
        assert_eq!(nesting_depth("a: [[[1]]]\n"), 3);
        assert_eq!(nesting_depth("a: [[1], [2], {b: [3]}]\n"), 3);
        assert_eq!(nesting_depth(&"- ".repeat(50)), 50);
        assert_eq!(
            nesting_depth(&format!("{}\n{}", "[".repeat(40), "]".repeat(40))),
            40
        );
        // Closed brackets in quoted scalars and comments leave nothing open.
        assert_eq!(nesting_depth("a: ['[x]', \"{y}\", # [z]\n  b]\n"), 1);
    }

    /// Each entry, in a collection and before 99 more levels: libyaml nests every bracket after
    /// it (each text here is valid YAML), so a reading that took part of the entry for a quoted
    /// scalar or a comment that goes on, or a bracket in it for structure, would undercount.
    #[test]
    fn quotes_comments_and_escapes_inside_a_collection_hide_no_bracket() {
        for entry in [
            // `'`, `"`, `#` and `:` inside a plain scalar are text, also on its next line.
            "a'",
            "a\"",
            "a#b",
            "a:b",
            "a 'b",
            "-'",
            "a\n'b",
            "a\t\"b",
            // Escapes in quoted scalars.
            "\"a\\\"\"",
            "'a'''",
            "\"\\\\\"",
            "'it''s'",
            // Quoted scalars and comments over lines, with closing brackets inside; a comment
            // ends at any of libyaml's line breaks.
            "\"\n]]\n\"",
            "'\n]]\n'",
            "a # ]]\n",
            "a # ]]\u{2028}",
            "a # ]]\u{85}",
            // Anchors, aliases and tags, a verbatim tag holding brackets and a comma.
            "&x a, *x",
            "!t a",
            "!<a,]]> b",
        ] {
            let nested = format!("[{entry}, {}{}", "[".repeat(99), "]".repeat(100));
            assert_eq!(nesting_depth(&nested), 100, "{entry:?}");
        }
    }

    #[test]
    fn brackets_outside_a_collection_may_be_overcounted() {
        // A bracket in a quoted value or a comment may start a collection, as far as the
        // scan can tell without following indentation.
        assert_eq!(nesting_depth("a: \"[[[\" # [[[\n"), 3);
        assert_eq!(nesting_depth("a: \"{x}{y}\" # see [1]\n"), 1);
    }
}
