package scripts

import (
	"context"

	"github.com/redis/go-redis/v9"
)

// A Head starts the EVALSHA command of one script, for the calls made once
// per job: the caller appends keys and arguments to the list Args returns
// and sends it with Run. Script.Run copies its keys and arguments into a
// new list and boxes the command's name, the hash and every key (each a
// separate allocation); a Head's list is the command itself, and its name
// and hash are boxed once.
type Head struct {
	src string // the script's source, for EVAL after NOSCRIPT
	sha any
}

// newHead returns the head of the EVALSHA calls of the script whose source
// is src.
func newHead(src string) *Head { return &Head{src: src, sha: redis.NewScript(src).Hash()} }

// The heads of the scripts called once per job or per tick.
var (
	ProduceHead  = newHead(produceFull)
	CompleteHead = newHead(completeFull)
)

// Client is what Run needs of a go-redis client: a single node's, a
// cluster's or a ring's.
type Client interface {
	Process(ctx context.Context, cmd redis.Cmder) error
}

// Args returns an EVALSHA argument list with room for n more values: the
// command, the hash and numKeys. The caller appends numKeys keys, then the
// script's arguments.
func (h *Head) Args(numKeys, n int) []any {
	args := make([]any, 3, 3+n)
	args[0], args[1], args[2] = "evalsha", h.sha, numKeys
	return args
}

// Command returns the EVALSHA argument list of keys and args.
func (h *Head) Command(keys, args []any) []any {
	list := h.Args(len(keys), len(keys)+len(args))
	return append(append(list, keys...), args...)
}

// Queue adds args (built on Args or Command) to a pipeline, whose caller
// sends the command again with Eval if it fails with NOSCRIPT.
func (h *Head) Queue(ctx context.Context, pipe redis.Pipeliner, args []any) *redis.Cmd {
	return send(ctx, pipe, args)
}

// Run sends args (built on Args or Command). A server without the script
// (restarted, SCRIPT FLUSH) answers NOSCRIPT: Run sends the call again as an
// EVAL with the source, which loads it, as Script.Run does (a user limited
// to the commands streamq needs may not run SCRIPT LOAD). The list belongs
// to the returned command.
func (h *Head) Run(ctx context.Context, c Client, args []any) *redis.Cmd {
	cmd := send(ctx, c, args)
	if err := cmd.Err(); err == nil || !redis.HasErrorPrefix(err, "NOSCRIPT") {
		return cmd
	}
	return h.Eval(ctx, c, args)
}

// Eval sends args (built on Args or Command) as an EVAL with the script's
// source, which loads the script: the call again after NOSCRIPT.
func (h *Head) Eval(ctx context.Context, c Client, args []any) *redis.Cmd {
	eval := make([]any, len(args))
	copy(eval, args)
	eval[0], eval[1] = "eval", h.src
	return send(ctx, c, eval)
}

func send(ctx context.Context, c Client, args []any) *redis.Cmd {
	cmd := redis.NewCmd(ctx, args...)
	if n, _ := args[2].(int); n > 0 {
		cmd.SetFirstKeyPos(3) // a cluster routes the call by its first key
	}
	_ = c.Process(ctx, cmd)
	return cmd
}
