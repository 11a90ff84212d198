"""astream.stages"""
