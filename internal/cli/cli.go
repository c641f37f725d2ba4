// Package cli is the streamq operator command line (cmd/streamq): it lists
// queues, shows statistics and consumers, inspects and repairs dead letters,
// looks up and forgets request ids, and trims streams, all through the public
// streamq.Admin API. main only calls Main, so tests run the whole command
// line in-process against a real Redis.
package cli

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"runtime/debug"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq"
)

// Exit codes of Main, for scripts.
const (
	ExitOK       = 0 // the command did what was asked
	ExitError    = 1 // it failed: Redis unreachable, refused, a running job not forgotten...
	ExitUsage    = 2 // the command line is wrong (unknown command or flag, missing argument, no --yes, a malformed dead letter id)
	ExitNotFound = 3 // the queue, request id or dead letter does not exist
)

// defaultRedisURL is used when neither --redis nor REDIS_URL is set.
const defaultRedisURL = "redis://localhost:6379/0"

// usageError is a mistake on the command line (exit 2).
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error { return usageError{fmt.Sprintf(format, args...)} }

// command is one entry of the subcommand table.
type command struct {
	name    string // "dlq ls"
	args    string // positional arguments, for the usage line
	summary string // one line, for the command list
	help    string // the longer explanation shown by --help
	read    bool   // a read command: has --json
	flags   func(fs *flag.FlagSet, o *opts)
	run     func(ctx context.Context, r *runner) error
}

// opts holds every flag of every command; each command registers the ones it uses.
type opts struct {
	redisURL      string
	cluster       bool
	timeout       time.Duration
	json          bool
	group         string
	yes           bool
	all           bool
	force         bool
	watch         bool
	interval      time.Duration
	count         int
	after         string
	limit         int64
	staleAfter    time.Duration
	state         string
	cursor        string
	id            string
	errorContains string
	span          time.Duration
}

// runner is what a command runs with.
type runner struct {
	o      opts
	args   []string
	stdout io.Writer
	stderr io.Writer
	client redis.UniversalClient
}

// Main runs the command line args (without the program name), writing to
// stdout and stderr and reading the environment through getenv, and returns
// the exit code (ExitOK, ExitError, ExitUsage, ExitNotFound). It returns when
// ctx ends (e.g. stats --watch until interrupted).
func Main(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) string) int {
	err := run(ctx, args, stdout, stderr, getenv)
	var ue usageError
	switch {
	case err == nil:
		return ExitOK
	case errors.Is(err, flag.ErrHelp):
		return ExitOK
	case errors.As(err, &ue):
		fmt.Fprintf(stderr, "%s\nRun 'streamq --help' for usage.\n", prefixed(err))
		return ExitUsage
	case errors.Is(err, streamq.ErrInvalidDeadLetterID):
		fmt.Fprintln(stderr, prefixed(err))
		return ExitUsage
	case errors.Is(err, streamq.ErrNotFound):
		fmt.Fprintln(stderr, prefixed(err))
		return ExitNotFound
	default:
		fmt.Fprintln(stderr, prefixed(err))
		return ExitError
	}
}

// prefixed returns err's message starting with "streamq: " once.
func prefixed(err error) string {
	msg := err.Error()
	if strings.HasPrefix(msg, "streamq: ") {
		return msg
	}
	return "streamq: " + msg
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) string) error {
	var o opts
	global := flag.NewFlagSet("streamq", flag.ContinueOnError)
	global.SetOutput(io.Discard)
	connFlags(global, &o, getenv)
	if err := global.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			printUsage(stdout)
			return err
		}
		return usagef("%v", err)
	}
	rest := global.Args()
	if len(rest) == 0 {
		printUsage(stderr)
		return usagef("no command given")
	}
	if rest[0] == "help" {
		if len(rest) == 1 {
			printUsage(stdout)
			return nil
		}
		rest = append(rest[1:], "--help")
	}
	cmd, rest, err := findCommand(rest)
	var gh groupHelp
	if errors.As(err, &gh) {
		printGroupHelp(stdout, gh.group)
		return err
	}
	if err != nil {
		return err
	}
	// The globals parsed above are the defaults of the command's own copies.
	globals := map[string]string{}
	global.VisitAll(func(f *flag.Flag) { globals[f.Name] = f.Value.String() })
	fs := flag.NewFlagSet("streamq "+cmd.name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	connFlags(fs, &o, getenv)
	for name, v := range globals {
		_ = fs.Set(name, v)
	}
	if cmd.read {
		fs.BoolVar(&o.json, "json", false, "print JSON instead of a table")
	}
	if cmd.flags != nil {
		cmd.flags(fs, &o)
	}
	if err := fs.Parse(interleave(fs, rest)); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			printCommandHelp(stdout, cmd, fs)
			return err
		}
		return usagef("%s: %v", cmd.name, err)
	}
	r := &runner{o: o, args: fs.Args(), stdout: stdout, stderr: stderr}
	if cmd.name == "version" {
		return cmd.run(ctx, r)
	}
	client, err := connect(o)
	if err != nil {
		return err
	}
	defer client.Close()
	r.client = client
	return cmd.run(ctx, r)
}

// connFlags registers the connection flags, which every command accepts and
// which may also come before the command.
func connFlags(fs *flag.FlagSet, o *opts, getenv func(string) string) {
	def := getenv("REDIS_URL")
	if def == "" {
		def = defaultRedisURL
	}
	fs.StringVar(&o.redisURL, "redis", def, "Redis URL: redis://[user:password@]host:port/db, rediss:// for TLS (default $REDIS_URL, else "+defaultRedisURL+")")
	fs.BoolVar(&o.cluster, "cluster", false, "connect to a Redis Cluster (more nodes as ?addr=host:port in the URL)")
	fs.DurationVar(&o.timeout, "timeout", 10*time.Second, "time limit of each command (stats --watch: of each refresh)")
}

// interleave moves flags after positional arguments to the front, so that
// "dlq ls orders --json" works like "dlq ls --json orders" (package flag
// stops at the first positional argument).
func interleave(fs *flag.FlagSet, args []string) []string {
	var flags, pos []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		switch {
		case a == "--":
			pos = append(pos, args[i+1:]...)
			i = len(args)
		case strings.HasPrefix(a, "-") && len(a) > 1:
			flags = append(flags, a)
			name := strings.TrimLeft(a, "-")
			if strings.Contains(name, "=") {
				continue
			}
			f := fs.Lookup(name)
			if f == nil {
				continue // Parse reports it
			}
			if bf, ok := f.Value.(interface{ IsBoolFlag() bool }); ok && bf.IsBoolFlag() {
				continue
			}
			if i+1 < len(args) {
				flags = append(flags, args[i+1])
				i++
			}
		default:
			pos = append(pos, a)
		}
	}
	return append(flags, pos...)
}

// findCommand matches the longest command name at the start of args.
func findCommand(args []string) (*command, []string, error) {
	if len(args) >= 2 {
		if c := lookup(args[0] + " " + args[1]); c != nil {
			return c, args[2:], nil
		}
	}
	if c := lookup(args[0]); c != nil {
		return c, args[1:], nil
	}
	if isGroup(args[0]) {
		if len(args) > 1 && isHelpFlag(args[1]) {
			return nil, nil, groupHelp{args[0]}
		}
		if len(args) == 1 || strings.HasPrefix(args[1], "-") {
			return nil, nil, usagef("%s needs a subcommand: %s", args[0], strings.Join(subcommands(args[0]), ", "))
		}
		return nil, nil, usagef("unknown command %q; %s has: %s", args[0]+" "+args[1], args[0], strings.Join(subcommands(args[0]), ", "))
	}
	return nil, nil, usagef("unknown command %q", args[0])
}

// isHelpFlag reports whether arg asks for help, as package flag reads it.
func isHelpFlag(arg string) bool {
	switch arg {
	case "-h", "--h", "-help", "--help":
		return true
	}
	return false
}

// groupHelp asks for the help of a command group ("dlq --help"); it matches
// flag.ErrHelp, so Main exits 0.
type groupHelp struct{ group string }

func (g groupHelp) Error() string        { return "help of " + g.group }
func (g groupHelp) Is(target error) bool { return target == flag.ErrHelp }

// printGroupHelp lists the subcommands of group.
func printGroupHelp(w io.Writer, group string) {
	fmt.Fprintf(w, "Usage: streamq %s <subcommand> [arguments] [flags]\n\nSubcommands:\n", group)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for _, c := range commands {
		if g, _, ok := strings.Cut(c.name, " "); ok && g == group {
			fmt.Fprintf(tw, "  %s %s\t%s\n", c.name, c.args, c.summary)
		}
	}
	_ = tw.Flush()
	fmt.Fprintf(w, "\n'streamq %s <subcommand> --help' explains a subcommand and its flags.\n", group)
}

func lookup(name string) *command {
	for i := range commands {
		if commands[i].name == name {
			return &commands[i]
		}
	}
	return nil
}

func isGroup(word string) bool { return len(subcommands(word)) > 0 }

func subcommands(group string) []string {
	var out []string
	for _, c := range commands {
		if g, sub, ok := strings.Cut(c.name, " "); ok && g == group {
			out = append(out, sub)
		}
	}
	return out
}

// connect builds the client from the URL: go-redis ParseURL (ParseClusterURL
// with --cluster), so TLS (rediss://), ACL user and password, database and
// timeouts all come from it.
func connect(o opts) (redis.UniversalClient, error) {
	if o.cluster {
		co, err := redis.ParseClusterURL(o.redisURL)
		if err != nil {
			return nil, usagef("--redis %q: %v", redactURL(o.redisURL), err)
		}
		return redis.NewClusterClient(co), nil
	}
	ro, err := redis.ParseURL(o.redisURL)
	if err != nil {
		return nil, usagef("--redis %q: %v", redactURL(o.redisURL), err)
	}
	return redis.NewClient(ro), nil
}

// redactURL hides a password in an URL shown in an error.
func redactURL(u string) string {
	scheme, rest, ok := strings.Cut(u, "://")
	if !ok {
		return u
	}
	// The userinfo ends at the last "@" before the query: a password may
	// hold "@" itself.
	authority, _, _ := strings.Cut(rest, "?")
	at := strings.LastIndex(authority, "@")
	if at < 0 {
		return u
	}
	userinfo, host := rest[:at], rest[at+1:]
	if user, _, ok := strings.Cut(userinfo, ":"); ok {
		return scheme + "://" + user + ":xxxxx@" + host
	}
	return u
}

// withTimeout bounds one command's Redis work.
func (r *runner) withTimeout(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, r.o.timeout)
}

// need checks the number of positional arguments.
func (r *runner) need(n int, what string) error {
	if len(r.args) < n {
		return usagef("missing %s", what)
	}
	if len(r.args) > n {
		return usagef("unexpected argument %q", r.args[n])
	}
	return nil
}

// admin returns an Admin of queue with the command's group and stale threshold.
func (r *runner) admin(queue string) (*streamq.Admin, error) {
	a, err := streamq.NewAdmin(r.client, queue, &streamq.AdminOptions{Group: r.o.group, StaleAfter: r.o.staleAfter})
	if err != nil {
		return nil, usagef("%v", err)
	}
	return a, nil
}

// onQueue checks the positional arguments (the queue first), makes the
// queue's Admin and bounds ctx by --timeout. cancel is never nil.
func (r *runner) onQueue(ctx context.Context, n int, what string) (*streamq.Admin, context.Context, context.CancelFunc, error) {
	if err := r.need(n, what); err != nil {
		return nil, ctx, func() {}, err
	}
	a, err := r.admin(r.args[0])
	if err != nil {
		return nil, ctx, func() {}, err
	}
	ctx, cancel := r.withTimeout(ctx)
	return a, ctx, cancel, nil
}

// confirm refuses a destructive command without --yes.
func (r *runner) confirm(what string) error {
	if !r.o.yes {
		return usagef("%s; add --yes to do it", what)
	}
	return nil
}

func (r *runner) printJSON(v any) error {
	enc := json.NewEncoder(r.stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func (r *runner) table() *tabwriter.Writer {
	return tabwriter.NewWriter(r.stdout, 0, 4, 2, ' ', 0)
}

func printUsage(w io.Writer) {
	fmt.Fprint(w, `streamq inspects and repairs streamq queues in Redis.

Usage:
  streamq [--redis URL] <command> [arguments] [flags]

Connection (before or after the command):
  --redis URL     redis://[user:password@]host:port/db; rediss:// for TLS.
                  Default: $REDIS_URL, else `+defaultRedisURL+`.
  --cluster       the URL names a Redis Cluster node (more: ?addr=host:port).
  --timeout D     time limit of each command (default 10s).

Commands:
`)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for _, c := range commands {
		fmt.Fprintf(tw, "  %s %s\t%s\n", c.name, c.args, c.summary)
	}
	_ = tw.Flush()
	fmt.Fprint(w, `
Every read command takes --json: the JSON of the library's own types, so a
program decodes it into them (dlq ls: []streamq.DeadLetter; dlq show:
streamq.DeadLetter; job: streamq.JobInfo; jobs ls: streamq.JobsPage; stats:
streamq.Stats; consumers: []streamq.ConsumerInfo; history:
[]streamq.HistoryPoint). Bytes are base64 (payload, result); when they are
UTF-8 text, payload_text and result_text hold the text as well. Durations
are nanoseconds (fields ending in _ns), times RFC 3339 in UTC.
Commands that delete (dlq purge, forget, dlq requeue --all) do nothing
without --yes.

Exit codes: 0 ok, 1 error, 2 wrong usage, 3 queue/id/dead letter not found.

Start here:
  streamq queues                     which queues exist, with their counts
  streamq stats orders --watch       one queue, refreshed every 2s
  streamq dlq ls orders              why requests failed for good
  streamq dlq requeue orders <id>    run one again
  streamq job orders order-1234      where one request id stands
  streamq jobs ls orders --state scheduled   which jobs wait, and until when

'streamq <command> --help' explains a command and its flags.
`)
}

func printCommandHelp(w io.Writer, c *command, fs *flag.FlagSet) {
	fmt.Fprintf(w, "Usage: streamq %s %s [flags]\n\n%s\n", c.name, c.args, strings.TrimSpace(c.help))
	fmt.Fprint(w, "\nFlags:\n")
	var names []string
	fs.VisitAll(func(f *flag.Flag) { names = append(names, f.Name) })
	sort.Strings(names)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for _, n := range names {
		f := fs.Lookup(n)
		def := ""
		if f.DefValue != "" && f.DefValue != "false" && n != "redis" {
			def = " (default " + f.DefValue + ")"
		}
		fmt.Fprintf(tw, "  --%s\t%s%s\n", n, f.Usage, def)
	}
	_ = tw.Flush()
}

// version prints the module version the binary was built from.
func version(_ context.Context, r *runner) error {
	v := "(devel)"
	if bi, ok := debug.ReadBuildInfo(); ok {
		if bi.Main.Path == "github.com/streamq/streamq" && bi.Main.Version != "" {
			v = bi.Main.Version
		} else {
			for _, d := range bi.Deps {
				if d.Path == "github.com/streamq/streamq" {
					v = d.Version
				}
			}
		}
	}
	fmt.Fprintf(r.stdout, "streamq %s\n", v)
	return nil
}
